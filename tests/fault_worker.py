"""One rank of a fault scenario (started by ``tests.parity.launch``, or by torchrun):

    python -m tests.fault_worker SCENARIO OUT_DIR [ARGS...]

Scenarios: ``kill`` (rank 1 SIGKILLs itself at step 3), ``stall`` (rank 1 sleeps in training_step at step 3),
``uneven`` (rank 1's loader has fewer batches), ``shapes`` (tp=2, rank 1's batch has another sequence length),
``bn`` (a BatchNorm model under ``ddp`` or ``fourd``/``fourd-nobroadcast``, rank 0 saves its final state),
``preempt`` (cycles of train / signal at a random moment / resume; see tests/test_fault_tolerance.py),
``mismatch`` (a log(sync_dist=True) on rank 0 only), ``crossed`` (rank 0 and rank 1 issue different collectives
at step 2, under a training timeout of ARGS[0] seconds).
"""

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d import FourDStrategy, checkpoint
from lightning_4d.checkpoint import sharded
from lightning_4d.faults import FaultTolerance, Preempted
from tests.models import Classifier, classification_data

WORLD = RANK = None  # this rank's, read when it starts (Lightning's teardown clears the variables)
FAST = dict(heartbeat_interval=0.5, lost_after=3.0, stall_after=6.0)


def _trainer(strategy, max_steps, callbacks=(), **options):
    checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy,
                      max_steps=max_steps, logger=False, enable_checkpointing=checkpointing, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=list(callbacks), **options)


class Misbehave(Callback):
    """At step 3 on rank 1: die (SIGKILL) or stall in user code."""

    def __init__(self, how):
        self.how = how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            print(f"rank 1 misbehaves ({self.how}) at t={time.time():.3f}", flush=True)
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1000)


def liveness(how):
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(FourDStrategy(dp=2), 20, [Misbehave(how), FaultTolerance(**FAST)])
    trainer.fit(Classifier(), DataLoader(classification_data(size=256), batch_size=8))


def uneven():
    rank = RANK
    data = classification_data(size=48 if rank == 1 else 64)
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(FourDStrategy(dp=2), 20, use_distributed_sampler=False)
    trainer.fit(Classifier(), DataLoader(data, batch_size=8))  # 6 batches on rank 1, 8 on rank 0


def shapes():
    from tests.lm_models import tiny_gpt

    rank = RANK
    tokens = torch.randint(0, 64, (16, 17 if rank == 0 else 13))
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(FourDStrategy(tp=2), 4, use_distributed_sampler=False)
    trainer.fit(tiny_gpt(), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))


class BatchNormNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batchnorm(kind, out):
    strategy = "ddp" if kind == "ddp" else FourDStrategy(dp=2, broadcast_buffers=kind == "fourd")
    pl.seed_everything(0, verbose=False)
    module = BatchNormNet()
    trainer = _trainer(strategy, 6)
    trainer.fit(module, DataLoader(classification_data(size=128), batch_size=8, shuffle=True))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save(state, Path(out) / f"bn-{kind}-rank{trainer.global_rank}.pt")
    if kind == "ddp":
        # Lightning's DDPStrategy leaves its gloo group to the interpreter's end, where torch sometimes aborts
        # ("terminate called without an active exception", seen twice in this baseline); a DDP script destroys
        # it, as torch documents. FourD's runs destroy theirs at exit themselves (faults/report.py).
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------- preemption


class StepRecorder(Callback):
    """Losses by global step (rank 0 writes them), and where the run was when it was preempted."""

    def __init__(self, out, name):
        self.out, self.name, self.losses = Path(out), name, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses[trainer.global_step] = float(trainer.strategy.reduce(loss.detach(), reduce_op="mean"))

    def _write(self, trainer, preempted_at=None):
        if trainer.global_rank == 0:
            weights = {k: v.tolist() for k, v in trainer.lightning_module.state_dict().items()}
            (self.out / f"{self.name}.json").write_text(json.dumps(
                {"losses": self.losses, "preempted_at": preempted_at, "weights": weights}))

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, Preempted):
            self._write(trainer, trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer)


class SignalAtRandom(Callback):
    """Sends SIGTERM to this process at a random moment: ``mid-step`` (a few ms into a step's forward, so
    it lands anywhere in the step) or ``mid-save`` (after the shards of a checkpoint are written, before it is
    renamed into place). Both ranks draw the same step; each rank its own delay."""

    def __init__(self, rng, where, first_step):
        self.where, self.step = where, first_step + rng.randrange(1, 3)
        self.delay = random.Random(rng.random() + RANK).uniform(0, 0.02)
        self.armed, self.timer = True, None

    def _fire_soon(self):
        self.armed = False
        self.timer = threading.Timer(self.delay, os.kill, (os.getpid(), signal.SIGTERM))
        self.timer.start()

    def on_exception(self, trainer, pl_module, exception):
        if self.timer is not None:
            self.timer.join()  # a signal still on its way is delivered while the handler is installed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.armed and self.where == "mid-step" and trainer.global_step == self.step:
            self._fire_soon()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.armed and self.where == "mid-save" and trainer.global_step == self.step:
            original = sharded._write_checksums

            def signal_while_saving(*args, **kwargs):
                sharded._write_checksums = original
                os.kill(os.getpid(), signal.SIGTERM)  # delivered right here, inside the save
                time.sleep(self.delay)
                return original(*args, **kwargs)

            sharded._write_checksums = signal_while_saving
            self.armed = False


PREEMPT_STEPS = 40


def _preempt_fit(out, name, ckpt_dir, callbacks, resume):
    pl.seed_everything(7, verbose=False)
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=1, save_last=True)
    # The recorder before FaultTolerance, which ends the step that is preempted.
    trainer = _trainer(FourDStrategy(dp=2), PREEMPT_STEPS, [StepRecorder(out, name), saver, *callbacks,
                                                            FaultTolerance()])
    trainer.fit(Classifier(), DataLoader(classification_data(), batch_size=8, shuffle=True),
                ckpt_path="last" if resume else None)
    return trainer


def preempt(out, first_cycle, cycles, seed):
    """``cycles`` preemptions in this process; the last one's exit status is the process's. Cycle -1 runs to
    the end from last.ckpt, then the uninterrupted reference."""
    out, rng = Path(out), random.Random(seed)
    ckpt_dir = out / "ckpt"
    if first_cycle < 0:
        _preempt_fit(out, "final", ckpt_dir, [], resume=True)
        _preempt_fit(out, "reference", out / "reference_ckpt", [], resume=False)
        return
    for cycle in range(first_cycle, first_cycle + cycles):
        start = checkpoint.read_meta(ckpt_dir / "last.ckpt")["global_step"] if (ckpt_dir / "last.ckpt").exists() else 0
        where = ["mid-step", "mid-save"][cycle % 2]
        print(f"cycle {cycle}: from step {start}, SIGTERM {where}", flush=True)
        try:
            _preempt_fit(out, f"cycle{cycle}", ckpt_dir, [SignalAtRandom(rng, where, start)], resume=start > 0)
        except Preempted as exit_:
            if cycle == first_cycle + cycles - 1:
                raise
            assert exit_.code == 75, exit_.code
            continue
        raise AssertionError(f"cycle {cycle} was not preempted")


class LogOnRank0Only(Classifier):
    """The issue's hang: ``self.log(..., sync_dist=True)`` on rank 0 only (an all-reduce rank 1 never issues)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.global_rank == 0 and self.global_step == 2:
            self.log("rank0_only", loss, sync_dist=True)
        return loss


def mismatch():
    from datetime import timedelta

    pl.seed_everything(0, verbose=False)
    trainer = _trainer(FourDStrategy(dp=2, timeout=timedelta(seconds=60)), 10, [FaultTolerance(**FAST)])
    trainer.fit(LogOnRank0Only(), DataLoader(classification_data(), batch_size=8))


class CrossedCollectives(Classifier):
    """At step 2 rank 0 all-reduces over the replica group while rank 1 broadcasts over the world: two different
    collectives, no rank dead or behind, so only the collective timeout ends them."""

    def training_step(self, batch, batch_idx):
        import torch.distributed as dist

        if self.global_step == 2:
            print(f"rank {self.global_rank} crosses at t={time.time():.3f}", flush=True)
            value = torch.ones(3)
            if self.global_rank == 0:
                dist.all_reduce(value, group=self.trainer.strategy.mesh.group("dp_cp"))
            else:
                dist.broadcast(value, src=0)
        return super().training_step(batch, batch_idx)


def crossed(seconds):
    from datetime import timedelta

    pl.seed_everything(0, verbose=False)
    trainer = _trainer(FourDStrategy(dp=2, timeout=timedelta(seconds=seconds)), 10, [FaultTolerance(**FAST)])
    trainer.fit(CrossedCollectives(), DataLoader(classification_data(), batch_size=8))


class SlowSteps(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.05)
        if trainer.global_rank == 0:
            print(f"at step {trainer.global_step}", flush=True)


def preempt_by_agent(out):
    """Trains until the launcher (torchrun's agent, a scheduler) sends SIGTERM."""
    saver = ModelCheckpoint(dirpath=Path(out) / "ckpt", every_n_train_steps=3, save_last=True)
    pl.seed_everything(7, verbose=False)
    trainer = _trainer(FourDStrategy(dp=2), 400, [saver, SlowSteps()])
    trainer.fit(Classifier(), DataLoader(classification_data(), batch_size=8, shuffle=True))


if __name__ == "__main__":
    WORLD, RANK = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    scenario, out, *rest = sys.argv[1:]
    if scenario in ("kill", "stall"):
        liveness(scenario)
    elif scenario == "uneven":
        uneven()
    elif scenario == "shapes":
        shapes()
    elif scenario == "bn":
        batchnorm(rest[0], out)
    elif scenario == "mismatch":
        mismatch()
    elif scenario == "crossed":
        crossed(float(rest[0]))
    elif scenario == "preempt-agent":
        preempt_by_agent(out)
    elif scenario == "preempt":
        preempt(out, int(rest[0]), int(rest[1]), int(rest[2]))
