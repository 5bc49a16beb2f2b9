"""FourDStrategy configuration: clear errors before any process starts, registry name, LightningCLI YAML."""

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_4d
from lightning_4d import FourDStrategy, ParallelDims
from tests.parity import script_env

ROOT = Path(__file__).resolve().parent.parent


def test_auto_dp_takes_the_rest_of_the_world():
    assert ParallelDims.resolve(16, "auto", pp=2, cp=2, tp=2) == ParallelDims(dp=2, pp=2, cp=2, tp=2)
    assert ParallelDims.resolve(8, "auto", tp=2).dp == 4
    dims = ParallelDims.resolve(8, 2, pp=2, cp=1, tp=2)
    assert (dims.dp_enabled, dims.pp_enabled, dims.cp_enabled, dims.tp_enabled) == (True, True, False, True)


def test_layout_table_lists_every_rank_with_its_groups():
    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2)
    # tp innermost, then cp, then dp; pp outermost.
    assert dims.coordinates(0) == {"dp": 0, "pp": 0, "cp": 0, "tp": 0}
    assert dims.coordinates(1) == {"dp": 0, "pp": 0, "cp": 0, "tp": 1}
    assert dims.coordinates(2) == {"dp": 0, "pp": 0, "cp": 1, "tp": 0}
    assert dims.coordinates(4) == {"dp": 1, "pp": 0, "cp": 0, "tp": 0}
    assert dims.coordinates(8) == {"dp": 0, "pp": 1, "cp": 0, "tp": 0}
    groups = dims.group_members(5)
    assert groups == {"dp": [1, 5], "pp": [5, 13], "cp": [5, 7], "tp": [4, 5], "dp_cp": [1, 3, 5, 7]}
    table = dims.layout_table().splitlines()
    assert len(table) == 3 + 16
    assert table[3 + 5].split("|")[5:] == [" 1,5      ", " 5,13     ", " 5,7      ", " 4,5      ", " 1,3,5,7    "]


def test_registry_name_and_defaults():
    assert "fourd" in StrategyRegistry
    strategy = pl.Trainer(accelerator="cpu", devices=1, strategy="fourd").strategy
    assert isinstance(strategy, FourDStrategy)
    assert strategy.parallel_dims == ParallelDims(dp=1, pp=1, cp=1, tp=1)
    assert lightning_4d.FourDStrategy is FourDStrategy


def _train_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "examples/train.py", "fit", "--config", "examples/configs/dp.yaml",
               "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
               "--model.n_layer", "1", "--data.max_bytes", "20000", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env=script_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_registry_name_through_lightning_cli_replaces_the_yaml_strategy(tmp_path):
    # examples/configs/dp.yaml (2 processes, Lightning's own launcher), its class_path + init_args replaced by the
    # registry name on the command line. The YAML's class_path itself trains in
    # tests/test_demo_configs.py::test_baseline_gives_the_parallel_loss_at_every_step[dp.yaml], which checks the
    # same layout line.
    out = _train_cli("--trainer.strategy", "fourd", "--trainer.default_root_dir", str(tmp_path / "name"))
    assert "lightning-4d layout: dp=2 pp=1 cp=1 tp=1 (world 2)" in out.stdout + out.stderr


def test_yaml_arguments_are_typed(tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(FourDStrategy, "strategy")
    config = parser.parse_args(["--strategy.tp=2", "--strategy.bucket_mb=4.5", "--strategy.timeout=0:01:00"])
    strategy = parser.instantiate_classes(config).strategy
    assert strategy.requested_sizes["tp"] == 2 and strategy.composition["bucket_mb"] == 4.5 and strategy.timeout == timedelta(minutes=1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy.tp=two"])


def test_reduce_over_one_replica_issues_no_collective(monkeypatch):
    """Lightning's reduce is a barrier and an all-reduce; over a group of one replica (dp=1: tp, pp or cp alone)
    the value is already the replicas' mean or sum, so the strategy returns it without either."""
    import torch
    import torch.distributed as dist

    class OneReplica:
        def group(self, name):
            assert name == "dp"
            return "the group of one replica"

    strategy = FourDStrategy(tp=2)
    strategy.mesh = OneReplica()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 if group == "the group of one replica" else 2)
    issued = []
    monkeypatch.setattr(lightning_4d.strategy.compat, "sync_ddp_if_available",
                        lambda *args, **kwargs: issued.append(args))
    value = torch.tensor([3, 5])
    assert strategy.reduce(value, reduce_op="mean") is value and strategy.reduce(value, reduce_op="sum") is value
    assert issued == []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # two replicas: Lightning's reduce runs
    strategy.reduce(value)
    assert len(issued) == 1
