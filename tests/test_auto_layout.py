"""``FourDStrategy(layout="auto")`` (:mod:`lightning_4d.composition.auto_layout`): the choice keeps the sizes the
user gave, fits the budget, never picks a layout the strategy refuses, uses context parallelism only where
nothing else fits, and refuses an impossible budget naming the memory that fits; arguments are checked at
construction; and a 2-process run with ``layout="auto"`` (from a LightningCLI YAML too) trains at one process's
numbers for the batch it chose, every rank holding the same layout."""

import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from lightning_4d import FourDStrategy
from lightning_4d.composition.auto_layout import check_auto_layout, choose, fixed_sizes, held_bytes, trials_beside
from lightning_4d.planner import Model, PlanError, Training, plan
from lightning_4d.planner.step_time import Link, Machine
from tests.parity import ROOT, Case, assert_parity, reference, run_layout, script_env

GPT = Model.from_sizes(layers=4, hidden=256, heads=4, vocab=512)
TRAINING = Training(seq_len=1, global_batch=1)
MACHINE = Machine(matmul_flops={"float32": 1e10}, memory_bandwidth=1e10, links={2: Link(1e-4, 1e9), 4: Link(2e-4, 1e9)},
                  devices_per_node=4, source="test figures")


def _choose(memory=2**34, fixed=None, refused=None, seq=256, batch=4):
    return choose(GPT, batch, seq, TRAINING, 4, fixed or {}, memory, MACHINE, refused)


def test_the_choice_is_the_fastest_per_sample_and_keeps_the_sizes_given():
    choice = _choose()
    per_sample = [est.step.total / est.training.global_batch for est in choice.candidates]
    assert per_sample == sorted(per_sample) and choice.estimate is choice.candidates[0]
    assert all(est.training.global_batch == 4 * est.layout.data_parallel for est in choice.candidates)
    kept = _choose(fixed={"tp": 2})
    assert {est.layout.tp for est in kept.candidates} == {2}
    assert "layout=\"auto\" chose" in kept.describe() and "ms/sample" in kept.describe()


def test_a_refused_layout_is_never_chosen_and_cp_only_where_nothing_else_fits():
    no_pipeline = _choose(refused=lambda layout: "manual optimization" if layout.pp > 1 else None)
    assert all(est.layout.pp == 1 for est in no_pipeline.candidates)
    assert all(est.layout.cp == 1 for est in _choose().candidates)
    full = replace(TRAINING, seq_len=65536, activation_checkpointing="full")
    every = plan(GPT, full, 4, include_unfit=True)  # a batch of 1 per replica: dp layouts do not apply
    with_cp = min(est.memory["total"] for est in every if est.layout.cp > 1)
    without = min(est.memory["total"] for est in every if est.layout.cp == 1)
    assert with_cp < without
    budget = (with_cp + without) / 2  # only a cp layout fits
    tight = choose(GPT, 1, 65536, full, 4, {"dp": 1}, budget, MACHINE)
    assert tight.layout.cp > 1 and tight.estimate.memory["total"] <= budget


def test_an_impossible_budget_is_refused_naming_the_smallest_memory_that_fits():
    with pytest.raises(PlanError, match=r"no layout fits in 1.00 MiB per device: the smallest estimate is .*memory_per"):
        _choose(memory=2**20)
    with pytest.raises(PlanError, match=r"keeps the sizes given \({'tp': 3}\)"):
        _choose(fixed={"tp": 3})


def test_arguments_are_checked_at_construction():
    assert fixed_sizes({"dp": "auto", "tp": 2, "pp": 1, "cp": 1, "dp_shard": "auto", "ep": 1}) == {"tp": 2}
    assert check_auto_layout("auto", "2GiB") == (True, 2.0 * 2**30, 1)
    assert check_auto_layout("auto", None, 3) == (True, None, 3)
    with pytest.raises(ValueError, match=r"layout_trials=0 must be a positive number of layouts"):
        FourDStrategy(layout="auto", layout_trials=0)
    with pytest.raises(ValueError, match=r"layout_trials=2 tries the layouts that layout=\"auto\" ranks"):
        FourDStrategy(layout_trials=2)
    with pytest.raises(ValueError, match=r"layout='manual': use \"auto\""):
        FourDStrategy(layout="manual")
    with pytest.raises(ValueError, match=r"memory_per_device=.80GiB. is the budget layout=\"auto\" chooses within"):
        FourDStrategy(memory_per_device="80GiB")
    with pytest.raises(ValueError, match=r"memory_per_device='lots': 'lots' is not a memory size"):
        FourDStrategy(layout="auto", memory_per_device="lots")


def test_two_processes_choose_one_layout_and_train_at_one_process_numbers(tmp_path):
    """The harness gives each rank a batch of ``batch_size // 2``; the reference takes the global batch of the
    layout chosen (that per-replica batch times its data-parallel ranks). With ``layout_trials=3`` the three
    layouts predicted fastest each run steps of a copy of the module first: the run then trains as without trials
    (the module untouched, torch's random state as before the set-up), every rank holding the same choice, and
    rank 0's description gives the three measured steps beside the predictions. Both runs keep the name of their
    keys in the rendezvous store from the callbacks' set-up on (the heartbeats' records and the failure reports
    meet under it; the layout's mesh was built after the callbacks' set-up and renamed the run before)."""
    common = dict(module="tests.lm_models:drawing_gpt", data="tests.lm_models:token_data", batch_size=8, max_steps=4,
                  callbacks=["tests.probes:ChosenLayout"])
    cases = [Case("auto", strategy={"layout": "auto"}, **common),
             Case("auto_trials", strategy={"layout": "auto", "layout_trials": 3}, **common)]
    result = run_layout(cases, 2, timeout=300, workdir=str(tmp_path))
    assert result.returncodes == [0, 0], result.output[-3000:]
    assert "layout=\"auto\" chose" in result.output
    described = result.output.split("the fastest per sample of the 3 predicted fastest, each measured over")
    assert len(described) == 2, result.output[-3000:]  # rank 0 only
    assert described[1].split("[lightning-4d]")[0].count("measured step") == 3, described[1][:3000]
    for case in cases:
        record = result.results[case.name]
        chosen = record["extras"]["chosen"]
        assert len(set(map(str, chosen["every_rank"]))) == 1, chosen
        assert chosen["random_state_kept"], case.name
        assert chosen["run_key_kept"], case.name  # failure reports find the heartbeats' records
        data_parallel = chosen["dp"] * chosen["dp_shard"]
        assert_parity(case, reference(replace(case, batch_size=4 * data_parallel)), record)


def test_trials_run_only_where_a_copy_fits_beside_the_module_as_held():
    """A trial lays out a copy beside the module: the module's bytes count (a meta-built one's do not), the
    candidates are tried in order up to the first that does not fit beside it, and with fewer than two left none
    is and the prediction chooses; rank 0's warning names the layout, its memory and the fix."""
    import torch

    assert held_bytes(torch.nn.Linear(4, 4, device="meta"), torch.device("cpu")) == 0
    assert held_bytes(torch.nn.Linear(4, 4), torch.device("cpu")) == (16 + 4) * 4
    assert held_bytes(torch.nn.Linear(4, 4), torch.device("cuda")) == 0  # the device's budget holds none of it
    ranked = _choose().candidates
    falling = ranked[:3]  # the fastest need the most memory here: 135, 122, 109 MiB
    assert falling[0].memory["total"] > falling[1].memory["total"] > falling[2].memory["total"]
    roomy = falling[0].memory["total"] + 2**20
    assert trials_beside(falling, 3, 2**20, roomy) == (falling, None)
    assert trials_beside(falling, 3, 2**21, roomy)[0] == []  # a module of 2 MiB leaves no room for the first
    assert trials_beside(falling, 1, 2**20, roomy) == ([], None)
    assert trials_beside(falling[:1], 2, 0, roomy) == (falling[:1], None)  # the one candidate there is
    # the first does not fit beside the module, the next two would: none is tried, the prediction chooses
    tried, warning = trials_beside(falling, 3, 2**20, falling[1].memory["total"] + 2**20)
    assert tried == [] and "3 of the 3 predicted fastest not tried" in warning and str(falling[0].layout) in warning
    assert "the prediction chose" in warning and "trainer.init_module(empty_init=True)" in warning
    rising = [ranked[5], ranked[4], ranked[3]]  # 55, 75, 81 MiB: the third does not fit, two are tried
    tried, warning = trials_beside(rising, 3, 2**20, rising[1].memory["total"] + 2**20)
    assert tried == rising[:2] and "1 of the 3 predicted fastest not tried" in warning
    assert str(rising[2].layout) in warning and "the prediction chose" not in warning
    small = rising[0].memory["total"]  # a module held whole and larger than its layout: copied whole beside itself
    tried, warning = trials_beside(rising[:1], 2, small + 5 * 2**20, 2 * small + 8 * 2**20)
    assert tried == [] and "needs" in warning
    tried, warning = trials_beside(rising, 3, 2**20, rising[0].memory["total"] + 2**20)  # one fits: none tried
    assert tried == [] and "2 of the 3 predicted fastest not tried" in warning and "the prediction chose" in warning


def test_the_trials_refuse_a_module_that_optimizes_manually():
    """A trial steps a copy as automatic optimization does; manual optimization is refused with the fix."""
    from lightning_4d.composition.layout_trials import check_trials_possible
    from tests.models import Classifier

    module = Classifier()
    check_trials_possible(module, 3)
    module.automatic_optimization = False
    check_trials_possible(module, 1)
    with pytest.raises(ValueError, match=r"layout_trials=3: Classifier optimizes manually .* Use layout_trials=1"):
        check_trials_possible(module, 3)


@pytest.mark.parametrize("budget", ["4GiB", "1MiB"])
def test_the_cli_yaml_takes_layout_auto(tmp_path, budget):
    """The example CLI's single-process config with ``layout: auto`` (and ``layout_trials: 2``, which measures the
    one layout one process has): trains within a budget it fits, and is refused naming the smallest memory that
    fits under one it does not."""
    config = yaml.safe_load((ROOT / "examples/configs/single.yaml").read_text())
    config["trainer"].update(max_steps=2, limit_val_batches=0, default_root_dir=str(tmp_path),
                             enable_progress_bar=False)
    config["trainer"]["strategy"]["init_args"] = {"layout": "auto", "memory_per_device": budget, "layout_trials": 2}
    config["model"].update(n_layer=2, n_embd=32, block_size=32)
    config["data"].update(seq_len=32, max_bytes=30_000)
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(config))
    run = subprocess.run([sys.executable, "examples/train.py", "fit", "--config", str(path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=script_env())
    if budget == "4GiB":
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        assert "layout=\"auto\" chose dp=1 pp=1 cp=1 tp=1" in run.stdout + run.stderr
        assert "the fastest per sample of the 1 predicted fastest" in run.stdout + run.stderr  # its one candidate
    else:
        assert run.returncode != 0 and "no layout fits in 1.00 MiB per device" in run.stderr, run.stderr[-3000:]
