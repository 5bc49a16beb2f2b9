"""A resume at any position of a run continues as the uninterrupted run (one process, ``FourDStrategy()``).

A run of 3 epochs of 4 shuffled batches, validated after the second epoch only (an epoch's end with and without
validation), is checkpointed everywhere a checkpoint is taken: after every step (``on_train_batch_end``:
FaultTolerance's preemption save, ``every_n_train_steps``), at the validation's end and in each
``on_train_epoch_end`` (ModelCheckpoint's epoch saves). Every checkpoint is resumed in a fresh Trainer, and the
runs resumed mid-epoch and at an epoch's end are checkpointed everywhere again and each of those resumed once
more: the chained case of docs/checkpoints.md ("Preemption"), an epoch's last batch of a run that was itself
resumed at an epoch's last batch, among them. Every resumed run must train the same samples in the same epochs,
start the same epochs (``on_train_epoch_start``) and end with the same weights, bit for bit, as the uninterrupted
run: under ``max_epochs`` and under ``max_steps`` (Lightning restarts a finished epoch only under ``max_steps``).
A run that ``max_steps`` ends mid-epoch, resumed with more steps, goes on as the longer uninterrupted run.

All runs are in one child process (``python -m tests.test_resume_positions OUT``): a Trainer of this strategy in
the test process would leave its process group and rendezvous variables to the tests after it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCHES, EPOCHS, BATCH = 4, 3, 3  # batches per epoch, epochs, samples per batch
MODES = {"max_epochs": dict(max_epochs=EPOCHS), "max_steps": dict(max_epochs=-1, max_steps=BATCHES * EPOCHS)}
CUT_AT = BATCHES + 2  # the second epoch's second step
TRAINERS = dict(MODES, cut_short=dict(max_epochs=-1, max_steps=CUT_AT))
RESUMED_AGAIN = ("step2", "step4", "end4", "val8")  # mid-epoch, and the kinds of checkpoint at an epoch's end


class Samples(pl.LightningModule):
    """A linear layer with momentum and a per-epoch learning rate (optimizer and scheduler state must come back
    too); it records the samples of each step and the epochs it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.seen: list[tuple[int, list[int]]] = []
        self.started: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.started.append(self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, ids = batch
        self.seen.append((self.current_epoch, ids.tolist()))
        return self.net(x).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.net(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def _samples() -> TensorDataset:
    features = torch.randn(BATCHES * BATCH, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(features, torch.arange(BATCHES * BATCH))


class Checkpoints(Callback):
    """A checkpoint at every position, named by kind and step (``step4``, ``val4``, ``end4``)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.positions = directory, []

    def _save(self, trainer: pl.Trainer, kind: str) -> None:
        name = f"{kind}{trainer.global_step}"
        while any(name == taken for taken, _, _ in self.positions):  # a wrong resume may pass a position twice
            name += "+"
        trainer.save_checkpoint(self.directory / f"{name}.ckpt")
        self.positions.append((name, trainer.global_step, trainer.current_epoch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._save(trainer, "step")

    def on_validation_end(self, trainer, pl_module):
        self._save(trainer, "val")

    def on_train_epoch_end(self, trainer, pl_module):
        self._save(trainer, "end")


def _fit(mode: str, ckpt: Path | None = None, saves: Path | None = None) -> tuple[dict, list]:
    from lightning_4d import FourDStrategy
    from tests.parity import full_weights

    pl.seed_everything(0, verbose=False)  # the sampler's shuffling seed
    module, callbacks = Samples(), [Checkpoints(saves)] if saves else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=1, check_val_every_n_epoch=2, callbacks=callbacks,
                         **TRAINERS[mode])
    trainer.fit(module, DataLoader(_samples(), batch_size=BATCH, shuffle=True),
                DataLoader(_samples(), batch_size=BATCH), ckpt_path=ckpt)
    run = {"seen": module.seen, "started": module.started, "weights": full_weights(trainer)}
    return run, callbacks[0].positions if saves else []


def _all_runs(out: Path) -> None:
    """Every mode's uninterrupted run, each position resumed, and the runs of ``RESUMED_AGAIN`` resumed again."""
    results = {}
    for mode in MODES:
        base = out / mode / "uninterrupted"
        uninterrupted, positions = _fit(mode, saves=base)
        resumed, chained = {}, {}
        for name, _, _ in positions:
            again = out / mode / name if name in RESUMED_AGAIN else None
            resumed[name], later = _fit(mode, base / f"{name}.ckpt", again)
            for position in later:
                chained[(name, position[0])] = (_fit(mode, again / f"{position[0]}.ckpt")[0], position)
        results[mode] = {"uninterrupted": uninterrupted, "positions": positions, "resumed": resumed,
                         "chained": chained}
    # A run that max_steps ends in the middle of an epoch, resumed with the steps of the whole run.
    _, positions = _fit("cut_short", saves=out / "cut_short")
    results["cut_short"] = {name: (_fit("max_steps", out / "cut_short" / f"{name}.ckpt")[0], (name, step, epoch))
                            for name, step, epoch in positions if step == CUT_AT}
    torch.save(results, out / "results.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.parity import ROOT, script_env

    out = tmp_path_factory.mktemp("resume_positions")
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "tests.test_resume_positions", str(out)], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=600)
    print(f"resume positions: all runs in {time.time() - start:.1f} s")
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out / "results.pt")


def _differences(uninterrupted: dict, run: dict, step: int, epoch: int) -> list[str]:
    """How ``run``, resumed after ``step`` of ``epoch``, differs from the uninterrupted run from there on."""
    problems = []
    if run["seen"] != uninterrupted["seen"][step:]:
        problems.append(f"trained (epoch, samples) {run['seen']}, uninterrupted {uninterrupted['seen'][step:]}")
    started = [e for e in uninterrupted["started"] if e > epoch]
    if run["started"] != started:
        problems.append(f"started epochs {run['started']}, uninterrupted {started}")
    changed = [k for k, v in uninterrupted["weights"].items() if not torch.equal(run["weights"][k], v)]
    if changed:
        problems.append(f"weights {changed} differ")
    return problems


@pytest.mark.parametrize("mode", list(MODES))
def test_a_resume_at_every_position_continues_as_the_uninterrupted_run(runs, mode):
    """Each checkpoint of the uninterrupted run, resumed once."""
    results = runs[mode]
    uninterrupted, positions = results["uninterrupted"], results["positions"]
    assert len(uninterrupted["seen"]) == BATCHES * EPOCHS and uninterrupted["started"] == list(range(EPOCHS))
    orders = [[ids for epoch, ids in uninterrupted["seen"] if epoch == e] for e in range(EPOCHS)]
    assert len({str(order) for order in orders}) == EPOCHS, orders  # every epoch is shuffled its own way
    assert len(positions) == (BATCHES + 1) * EPOCHS + EPOCHS // 2, positions  # each step, epoch and validation end
    failed = {name: problems for name, step, epoch in positions
              if (problems := _differences(uninterrupted, results["resumed"][name], step, epoch))}
    assert not failed, f"{len(failed)} of {len(positions)} resumes differ: {failed}"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_resume_of_a_resumed_run_continues_as_the_uninterrupted_run(runs, mode):
    """Each checkpoint of a resumed run (resumed at ``RESUMED_AGAIN``), resumed again."""
    results = runs[mode]
    chained = results["chained"]
    # The case of docs/checkpoints.md: resumed at the first epoch's last batch, checkpointed at the second's.
    assert ("step4", f"step{2 * BATCHES}") in chained
    assert {first for first, _ in chained} == set(RESUMED_AGAIN)
    failed = {f"{first} then {second}": problems for (first, second), (run, (_, step, epoch)) in chained.items()
              if (problems := _differences(results["uninterrupted"], run, step, epoch))}
    assert not failed, f"{len(failed)} of {len(chained)} second resumes differ: {failed}"


def test_an_epoch_cut_short_by_max_steps_goes_on_as_the_uninterrupted_run(runs):
    """Resumed with more steps, the epoch goes on where it stopped, from the checkpoint after its last step and
    from the one of its ``on_train_epoch_end`` (Lightning's counters call that epoch finished: one ahead)."""
    resumed = runs["cut_short"]
    assert set(resumed) == {f"step{CUT_AT}", f"end{CUT_AT}"}
    failed = {name: problems for name, (run, (_, step, epoch)) in resumed.items()
              if (problems := _differences(runs["max_steps"]["uninterrupted"], run, step, epoch))}
    assert not failed, failed


if __name__ == "__main__":
    _all_runs(Path(sys.argv[1]))
