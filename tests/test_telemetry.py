"""Telemetry: the values a short run writes to a CSV logger are present and plausible, under each layout.

The distributed runs start this file as a worker (``python -m tests.test_telemetry SPEC``): every rank fits
the tiny example GPT under each layout of the spec with a CSVLogger and the Telemetry callback.
"""

import csv
import json
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_4d.observability.telemetry import Telemetry, attention_flops, count_tokens, matmul_params, peak_flops_for
from tests.lm_models import SEQ, tiny_gpt, token_data
from tests.parity import launch, rank_tails

PEAK = 1e12  # a made-up device peak, so that MFU is computed on CPU
STEPS, EVERY = 7, 3  # the first batch is not timed: two windows of three batches
GLOBAL_BATCH = 8
LAYOUTS = [{"dp": 2}, {"cp": 2}, {"tp": 2}, {"pp": 2}, {"dp_shard": 2}]


def expected_flops_per_token(module) -> float:
    """6N plus causal attention: per layer and token 2*h*(s+1) forward (the mean query sees (s+1)/2 keys), x3."""
    n = sum(p.numel() for name, p in module.named_parameters() if "tok_emb" not in name)
    return 6 * n + 3 * module.hparams.n_layer * 2 * module.hparams.n_embd * (SEQ + 1)


def _fit(layout: dict, root: Path, world_size: int) -> float:
    from lightning_4d import FourDStrategy

    pl.seed_everything(7, verbose=False)
    replicas = layout.get("dp", 1) * layout.get("dp_shard", 1)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=FourDStrategy(**layout), max_steps=STEPS,
                         logger=CSVLogger(root, name=_name(layout), version=0), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Telemetry(peak_flops=PEAK, log_every_n_steps=EVERY)])
    start = time.perf_counter()
    trainer.fit(tiny_gpt(), DataLoader(token_data(size=64), batch_size=GLOBAL_BATCH // replicas))
    return time.perf_counter() - start


def _name(layout: dict) -> str:
    return "_".join(f"{dim}{size}" for dim, size in layout.items())


def _worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    root = Path(spec["out"])
    walls = {_name(layout): _fit(layout, root, spec["world_size"]) for layout in spec["layouts"]}
    if dist.get_rank() == 0:
        (root / "wall.json").write_text(json.dumps(walls))


def _rows(path: Path) -> list[dict[str, float]]:
    with path.open() as f:
        return [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("telemetry")
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "world_size": 2, "layouts": LAYOUTS}))
    codes, output = launch(["-m", "tests.test_telemetry", str(spec)], 2, timeout=300)
    assert codes == [0, 0], rank_tails(output)
    walls = json.loads((out / "wall.json").read_text())
    return {name: (_rows(out / name / "version_0" / "metrics.csv"), wall) for name, wall in walls.items()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
def test_logged_values_are_present_and_plausible(runs, layout):
    rows, wall = runs[_name(layout)]
    dim = next(iter(layout))
    assert [row["step"] for row in rows] == [1 + EVERY, 1 + 2 * EVERY]
    flops_per_token = expected_flops_per_token(tiny_gpt())
    for row in rows:
        step_time = row["telemetry/step_time_s"]
        assert 0 < step_time and EVERY * step_time < wall
        # Every optimizer step trains the global batch once, whatever the layout.
        assert row["telemetry/tokens_per_s"] * step_time == pytest.approx(GLOBAL_BATCH * SEQ, rel=1e-9)
        assert row["telemetry/tokens_per_s_per_device"] == pytest.approx(row["telemetry/tokens_per_s"] / 2)
        # Attention counted from the kernels is the same under ring attention, split heads and stages.
        assert row["telemetry/flops_per_token"] == pytest.approx(flops_per_token, rel=1e-9)
        assert row["telemetry/tflops_per_device"] == pytest.approx(
            row["telemetry/tokens_per_s_per_device"] * flops_per_token / 1e12, rel=1e-9)
        assert 0 < row["telemetry/mfu"] < 1
        assert row["telemetry/mfu"] == pytest.approx(row["telemetry/tflops_per_device"] * 1e12 / PEAK)
        assert 0.05 < row["telemetry/peak_memory_gib_min"] <= row["telemetry/peak_memory_gib_max"] < 8
        comm = {key.split("/")[-1]: value for key, value in row.items() if key.startswith("telemetry/comm_s/")}
        assert set(comm) == {dim, "other"}
        # All traffic runs on the groups of the layout's one dim (Lightning's own reductions included).
        assert 0 < comm[dim] < step_time and comm["other"] == 0
        if dim == "pp":
            assert row["telemetry/pipeline_bubble"] == pytest.approx(comm["pp"] / step_time)
            assert 0 < row["telemetry/pipeline_bubble"] < 1
        else:
            assert "telemetry/pipeline_bubble" not in row


# ---------------------------------------------------------------------------------- in one process


class _SlowValidation(pl.LightningModule):
    """The tiny GPT whose validation takes 0.5 s, to show that validation is not counted as training time."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt()

    def training_step(self, batch, batch_idx):
        return self.gpt._loss(batch)

    def validation_step(self, batch, batch_idx):
        time.sleep(VALIDATION_S)

    def configure_optimizers(self):
        return self.gpt.configure_optimizers()


VALIDATION_S = 0.5


class _BatchTimes(pl.Callback):
    """Each training batch's wall time, from its start to its end (optimizer step included)."""

    def __init__(self) -> None:
        self.seconds, self._start = [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self._start)


def test_one_process_logs_no_communication_and_skips_validation_time(tmp_path):
    telemetry, batches = Telemetry(log_every_n_steps=4), _BatchTimes()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=CSVLogger(tmp_path, version=0),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, val_check_interval=2, limit_val_batches=1,
                         callbacks=[telemetry, batches])
    allreduce = vars(dist.ProcessGroup)["allreduce"]
    loader = DataLoader(token_data(), batch_size=4)
    trainer.fit(_SlowValidation(), loader, loader)
    assert vars(dist.ProcessGroup)["allreduce"] is allreduce, "the communication timers were not removed"
    rows = _rows(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    logged = [row for row in rows if "telemetry/step_time_s" in row]
    assert len(logged) == 1 and logged[0] == pytest.approx(telemetry.last_metrics | {"step": 5})
    # Two validations of VALIDATION_S ran inside the window of steps 2-5: counted, they would add half a second to
    # each step's mean. Bounded by the window's batches as measured beside it (their time moves with the load of the
    # machine), plus half of what validation would add: what lies between batches (loading one) is milliseconds.
    window = statistics.mean(batches.seconds[1:])
    assert 0 < logged[0]["telemetry/step_time_s"] < window + VALIDATION_S * 2 / 4 / 2, (logged[0], batches.seconds)
    assert logged[0]["telemetry/comm_s/other"] == 0
    assert "telemetry/mfu" not in logged[0]  # no peak is known for a CPU


def test_units():
    assert count_tokens((torch.zeros(2, 3), {"ids": torch.ones(4, 5, dtype=torch.long)})) == 20
    assert count_tokens({"mask": torch.ones(2, 2, dtype=torch.bool), "x": torch.zeros(3)}) == 0
    q = torch.zeros(2, 4, 8, 16)
    assert attention_flops(q, q, q, is_causal=False) == 2 * 8 * 8 * 8 * 32
    assert attention_flops(q, q, q, is_causal=True) == 2 * 8 * 36 * 32
    # Blocks of a causal sequence: the pairs of the parts add up to the pairs of the whole.
    half = torch.zeros(2, 4, 4, 16)
    assert 2 * attention_flops(half, half, half, True) + attention_flops(half, half, half, False) \
        == attention_flops(q, q, q, True)
    gpt = tiny_gpt(tie_weights=True)
    assert "model.tok_emb.weight" in matmul_params(gpt)  # tied: it is the head
    assert "model.tok_emb.weight" not in matmul_params(tiny_gpt())
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4e12
    assert peak_flops_for("NVIDIA H100 PCIe", "16-mixed") == 756e12
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # matmuls may use TF32
        assert peak_flops_for("NVIDIA A100-SXM4-80GB", "32-true") == 156e12
        torch.set_float32_matmul_precision("highest")
        assert peak_flops_for("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
    finally:
        torch.set_float32_matmul_precision(precision)
    assert peak_flops_for("NVIDIA A10G", "bf16-mixed") is None
    with pytest.raises(ValueError, match="peak_flops=0"):
        Telemetry(peak_flops=0)
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        Telemetry(log_every_n_steps=0)


if __name__ == "__main__":
    _worker(sys.argv[1])
