"""The example configs and their CLI: each parallel config has an exact single-process baseline (same model,
data, seed, global batch and sampler; the same loss at every step), and the strategy's short names work with
arguments on the command line and in YAML, and show in ``fit --help``."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_4d import FourDStrategy
from lightning_4d.demos.cli import main
from tests.parity import script_env

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
BASELINES = {"dp.yaml": "single.yaml", "demo.yaml": "demo_single.yaml"}  # parallel config -> its baseline
LOSS_LINE = re.compile(r"^step +(\d+)  (train_loss|val_loss) ([0-9.]+)$", re.M)


def _load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def test_every_parallel_config_has_a_baseline():
    parallel = {path.name for path in CONFIGS.glob("*.yaml") if _load(path.name)["trainer"]["devices"] > 1}
    assert parallel == set(BASELINES)
    for baseline in BASELINES.values():
        assert _load(baseline)["trainer"]["devices"] == 1


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baseline_is_the_same_run_on_one_process(name):
    """Everything but the layout is equal; the baseline's batch is the global batch (dp x per-replica batch)."""
    parallel, baseline = _load(name), _load(BASELINES[name])
    dp = parallel["trainer"]["strategy"]["init_args"]["dp"]
    assert baseline["data"]["batch_size"] == dp * parallel["data"]["batch_size"]
    assert baseline["trainer"]["strategy"] == {"class_path": "lightning_4d.FourDStrategy", "init_args": {"dp": 1}}
    for config in (parallel, baseline):
        for key in ("devices", "strategy", "default_root_dir"):
            config["trainer"].pop(key)
        config["data"].pop("batch_size")
    assert parallel == baseline


def _cheap(config: dict, root: Path, layout: dict | None) -> Path:
    """The config with few steps, a tiny model and, for a parallel config, a 2-process layout with its dp."""
    config = copy.deepcopy(config)
    trainer = config["trainer"]
    trainer.update(max_steps=3, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0,
                   enable_progress_bar=False, default_root_dir=str(root),
                   callbacks=[{"class_path": "lightning_4d.demos.callbacks.PrintLoss",
                               "init_args": {"every_n_steps": 1, "digits": 8}}])
    if layout is not None:
        trainer["devices"] = 2
        # the config's launcher is kept: demo.yaml forks its ranks, dp.yaml runs the script again per rank
        start = {key: value for key, value in trainer["strategy"]["init_args"].items() if key == "start_method"}
        trainer["strategy"]["init_args"] = {**layout, **start}
    config["model"].update(n_layer=2, n_embd=32, block_size=32)
    config["data"].update(seq_len=32, max_bytes=30_000)
    path = root / "config.yaml"
    root.mkdir(parents=True)
    path.write_text(yaml.safe_dump(config))
    return path


def _losses(config: Path, layout_line: str = "") -> list[tuple[int, str, float]]:
    """The losses the run printed; it must also print ``layout_line`` (the strategy the YAML named was built)."""
    done = subprocess.run([sys.executable, "examples/train.py", "fit", "--config", str(config)], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert layout_line in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    return [(int(step), name, float(value)) for step, name, value in LOSS_LINE.findall(done.stdout)]


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baseline_gives_the_parallel_loss_at_every_step(name, tmp_path):
    """Both launchers: demo.yaml forks its ranks (``start_method: fork``), dp.yaml starts them as scripts.

    The baseline is FourDStrategy with every size 1, not Lightning's default strategy: under any multi-process
    strategy Lightning draws training batches with a shuffling DistributedSampler (seeded by the run's seed),
    even from a loader made with ``shuffle=False``, and one process under the default strategy draws another
    order (measured: another first batch, loss 5.5553 against 5.5657), so no plain process sees the replicas'
    batches. The harness's references everywhere else are Lightning's default strategy (tests/parity.py)."""
    parallel = _load(name)
    dp = parallel["trainer"]["strategy"]["init_args"]["dp"]
    assert dp == 2, "the 2-process layout below keeps the config's dp"
    # the YAML's class_path + init_args through LightningCLI build the strategy (tests/test_strategy_config.py
    # replaces them by the registry name)
    got = _losses(_cheap(parallel, tmp_path / "parallel", {"dp": dp}),
                  "lightning-4d layout: dp=2 pp=1 cp=1 tp=1 (world 2)")
    want = _losses(_cheap(_load(BASELINES[name]), tmp_path / "baseline", None))
    assert [(step, kind) for step, kind, _ in want] == [(1, "train_loss"), (2, "train_loss"), (3, "train_loss"),
                                                        (3, "val_loss")]
    assert [(step, kind) for step, kind, _ in got] == [(step, kind) for step, kind, _ in want]
    for (step, kind, value), (_, _, expected) in zip(got, want):
        assert value == pytest.approx(expected, rel=1e-5), (step, kind, got, want)


def _strategy(*args: str) -> FourDStrategy:
    cli = main(["--trainer.accelerator", "cpu", "--trainer.devices", "4", "--trainer.logger", "false", *args],
               run=False)
    assert isinstance(cli.trainer.strategy, FourDStrategy)
    return cli.trainer.strategy


def test_short_names_with_and_without_sizes():
    assert _strategy("--trainer.strategy", "fourd").requested_sizes == {"dp": "auto", "pp": 1, "cp": 1, "tp": 1,
                                                               "dp_shard": 1, "ep": 1}
    strategy = _strategy("--trainer.strategy", "FourDStrategy", "--trainer.strategy.tp", "2",
                         "--trainer.strategy.dp", "2")
    assert strategy.requested_sizes == {"dp": 2, "pp": 1, "cp": 1, "tp": 2, "dp_shard": 1, "ep": 1}
    strategy = _strategy("--trainer.strategy", "FourDStrategy", "--trainer.strategy.dp_shard", "2",
                         "--trainer.strategy.tp", "2")
    assert strategy.requested_sizes == {"dp": "auto", "pp": 1, "cp": 1, "tp": 2, "dp_shard": 2, "ep": 1}


def test_short_class_name_in_yaml(tmp_path):
    config = tmp_path / "strategy.yaml"
    config.write_text("trainer:\n  strategy:\n    class_path: FourDStrategy\n    init_args: {pp: 2, tp: 2}\n")
    assert _strategy("--config", str(config)).requested_sizes == {"dp": "auto", "pp": 2, "cp": 1, "tp": 2,
                                                                  "dp_shard": 1, "ep": 1}


def test_fit_help_names_the_short_names():
    done = subprocess.run([sys.executable, "examples/train.py", "fit", "--help"], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "lightning-4d: 'fourd' (default sizes, dp='auto'), or with sizes 'FourDStrategy' followed by" \
           " --trainer.strategy.dp/pp/cp/tp N" in text


@pytest.mark.parametrize("name", sorted(path.name for path in CONFIGS.glob("*.yaml")))
def test_configs_that_stop_by_steps_name_an_epoch_limit(name):
    """Without max_epochs, Lightning sets -1 and its rich progress bar reads "Epoch 0/-2"."""
    trainer = _load(name)["trainer"]
    assert trainer.get("max_epochs", 0) >= 1, name
