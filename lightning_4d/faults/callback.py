"""``FaultTolerance``: the Lightning side of fault handling, added by ``FourDStrategy`` to every Trainer.

Pass your own instance in ``Trainer(callbacks=[FaultTolerance(...)])`` to change its settings. Per training
step it costs one all-reduce of three integers over the world, launched as the step starts and read as it ends
(:mod:`.agreement`: no host read of the device, no object collective), and a broadcast of the buffers per
replica group only in steps that changed them.

* **Preemption** (:mod:`.preemption`): SIGTERM / SIGUSR1 only set a flag. Every rank puts its flag into the
  step's agreement as the step starts; if any rank had one, all save ``last.ckpt`` at the step's end
  (complete, then renamed into place) and exit with :data:`EXIT_PREEMPTED` (a signal that comes during a step
  is acted on at the end of the next one). Lightning's own SIGTERM handler, which
  broadcasts inside the signal handler and dead-locks with a checkpoint save, is replaced during ``fit``; so
  is the broadcast of Lightning's SIGTERM flag before every batch (a blocking world collective and a host read
  per step), which would only ever carry 0 while ours holds SIGTERM.
* **Uneven data**: the same agreement carries whether this batch was the rank's last of the epoch; when some
  replicas ran out and others did not, every rank raises :class:`UnevenDataError` naming the ranks and their
  batch counts.
* **Batch shapes**: before the first step of each fit (and every step of ``FourDStrategy(debug=True)``'s
  debug steps), ranks that must receive the same batch (equal dp coordinate) compare a hash of the batch's
  shapes; a difference raises :class:`BatchShapeMismatchError` on every rank, naming the
  ranks and shapes, instead of a collective aborting on a size mismatch mid-step.
* **Liveness** (:mod:`.liveness`): a heartbeat thread names a lost or stalled rank and ends every rank.
* **Collectives** (:mod:`.recorder`, :mod:`.timeouts`): every process-group call is recorded with the step and
  hook it was issued in, for the failure table; the strategy's ``init_timeout`` holds until the first training
  step has ended, its (shorter) ``timeout`` from then on.
* **Buffers**: with ``FourDStrategy(broadcast_buffers=True)`` (the default, as DDP), the module's buffers
  (BatchNorm running statistics, ...) are broadcast from the first rank of each replica group (``dp_cp``)
  before a training step whenever they changed since the last one (all of them on a fit's first step), so
  replicas never drift apart and the checkpoint holds what every rank holds.
"""

from __future__ import annotations

import hashlib
import signal
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d._compat import default_store, fetches_inside_step, skip_sigterm_broadcast, tensor_version
from lightning_4d.faults.agreement import StepAgreement
from lightning_4d.faults.liveness import (DEFAULT_INTERVAL, DEFAULT_LOST_AFTER, DEFAULT_STALL_AFTER, Heartbeat,
                                          check_options)
from lightning_4d.faults import recorder
from lightning_4d.faults.report import RaisedOnEveryRank
from lightning_4d.faults.preemption import EXIT_PREEMPTED, Preempted, SignalFlag, parse_signals
from lightning_4d.parallel_dims import ParallelMesh


class UnevenDataError(RaisedOnEveryRank):
    """Replicas have different numbers of batches: one ran out while others still had data."""


class BatchShapeMismatchError(RaisedOnEveryRank):
    """Ranks that must receive the same batch (tp, cp, pp peers) received batches of different shapes."""


class FaultTolerance(Callback):
    """See the module doc.

    Args:
        signals: the signals that request a checkpoint and a clean exit (names or numbers); ``()``: none.
        heartbeat: run the heartbeat thread (needs a process group with a store: every multi-rank run).
        heartbeat_interval: seconds between heartbeats.
        lost_after: a rank with no heartbeat for this long is lost; every other rank exits within about
            ``lost_after + heartbeat_interval`` seconds of its death.
        stall_after: a rank behind the others with no progress anywhere for this long is stalled; None: off.
        check_uneven_data: agree on the end of each replica's data at every step (see the module doc).
        check_batch_shapes: compare batch shapes between the ranks of a replica before every step.
    """

    def __init__(self, signals: tuple[Union[str, int], ...] = ("SIGTERM", "SIGUSR1"), heartbeat: bool = True,
                 heartbeat_interval: float = DEFAULT_INTERVAL, lost_after: float = DEFAULT_LOST_AFTER,
                 stall_after: Optional[float] = DEFAULT_STALL_AFTER, check_uneven_data: bool = True,
                 check_batch_shapes: bool = True) -> None:
        check_options(heartbeat_interval, lost_after, stall_after)
        self.signals = parse_signals(signals)
        self.heartbeat, self.heartbeat_interval = heartbeat, heartbeat_interval
        self.lost_after, self.stall_after = lost_after, stall_after
        self.check_uneven_data, self.check_batch_shapes = check_uneven_data, check_batch_shapes
        self._flag = SignalFlag(self.signals)
        self._beat: Optional[Heartbeat] = None
        self._first_step_done = False
        self._buffer_versions: dict[int, int] = {}  # id(buffer) -> its version when last broadcast
        self._agreement: Optional[StepAgreement] = None  # with more than one rank
        self._restore_sigterm_broadcast: Callable[[], None] = _nothing  # Lightning's per-step SIGTERM broadcast

    # ---------------------------------------------------------------------------- set up, tear down

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        timeouts = getattr(trainer.strategy, "collective_timeouts", None)
        if timeouts is not None:
            timeouts.starting()
        self._first_step_done = False
        self._buffer_versions = {}  # every buffer is broadcast on the first step of each fit
        self._agreement = None
        if dist.is_initialized() and trainer.world_size > 1:
            self._agreement = StepAgreement(None, trainer.strategy.root_device)
            recorder.install()
            recorder.RECORDER.name_groups(_named_groups(trainer))
        store = default_store()
        if self.heartbeat and self._beat is None and store is not None and trainer.world_size > 1:
            self._beat = Heartbeat(store, trainer.global_rank, trainer.world_size, self.heartbeat_interval,
                                   self.lost_after, self.stall_after).start()
        if stage == "fit":
            self._flag.install()

    # Lightning installs its own SIGTERM handler after ``setup`` (it broadcasts inside the handler); ours goes
    # back on top before the first step runs.
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flag.install()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flag.install()
        if signal.SIGTERM in self.signals and self._agreement is not None:  # our agreement carries it instead
            self._restore_sigterm_broadcast = skip_sigterm_broadcast(trainer)
        self._mark("on_train_start", trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._beat is not None:
            self._beat.stop("finished")
            self._beat = None
        if stage == "fit":
            self._flag.uninstall()  # a signal that came after the last step is delivered as if we were not here
            self._restore_sigterm_broadcast()
            self._restore_sigterm_broadcast = _nothing

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_sigterm_broadcast()
        self._restore_sigterm_broadcast = _nothing
        if isinstance(exception, Preempted):
            self._flag.received.clear()  # acted on: not delivered again when the handler is uninstalled
            if self._beat is not None:
                self._beat.stop("preempted")
            self._flag.uninstall()  # Lightning calls no ``teardown`` hook after an exception
        # Other failures: the strategy's failure report stops the heartbeat once it has claimed or read the first
        # failure (stopping it here would let a peer think this rank left on purpose and blame itself), and
        # gives the signal handlers back once it has printed (a launcher's SIGTERM would cut it short).
        self._beat = None

    # ------------------------------------------------------------------------------ progress marks

    def _mark(self, doing: str, trainer: pl.Trainer) -> None:
        recorder.RECORDER.where(doing, trainer.global_step)
        if self._beat is not None:
            self._beat.mark(doing, trainer.global_step)

    def on_before_backward(self, trainer, pl_module, loss):
        self._mark("backward", trainer)

    def on_after_backward(self, trainer, pl_module):
        self._mark("after backward", trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._mark("optimizer step", trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._mark(f"validation batch {batch_idx}", trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._mark(f"after validation batch {batch_idx}", trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._mark("saving a checkpoint", trainer)

    # ------------------------------------------------------------------------------- step boundary

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._mark("comparing batch shapes", trainer)
        if self.check_batch_shapes and self._compare_now(trainer):
            self._compare_batch_shapes(trainer, batch)
        if getattr(trainer.strategy, "broadcast_buffers", False):
            self._mark("broadcasting buffers", trainer)
            broadcast_buffers(pl_module, _group(trainer, "dp_cp"), self._buffer_versions)
        if self._agreement is not None and not fetches_inside_step(trainer):
            self._agreement.start(self._flags(trainer))
        self._mark("training_step", trainer)

    def _compare_now(self, trainer: pl.Trainer) -> bool:
        """The first step of each fit, and every step of the strategy's debug steps (``debug=True``): a comparison
        is a host read of every rank's shapes, which a GPU step must not wait for."""
        strategy = trainer.strategy
        debugging = getattr(strategy, "debug", False) and trainer.global_step < getattr(strategy, "debug_steps", 0)
        return not self._first_step_done or debugging

    def _flags(self, trainer: pl.Trainer) -> list[int]:
        """This rank's part of the step's agreement: a preemption signal came; this batch is the epoch's last
        (the fetcher looked ahead); it is not (the maximum of both tells whether all replicas ended together)."""
        last = int(bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch))
        return [int(self._flag.requested), last, 1 - last]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._mark("end of step agreement", trainer)
        if not self._first_step_done:
            self._first_step_done = True
            timeouts = getattr(trainer.strategy, "collective_timeouts", None)
            if timeouts is not None:
                timeouts.training()
        if self._agreement is None:
            if self._flag.requested:
                self._preempt(trainer, [0])
            return
        if not self._agreement.started:  # a fetcher that fetches inside training_step: its last batch is known now
            self._agreement.start(self._flags(trainer))
        requested, some_ended, some_have_more = self._agreement.result()
        done = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
        if self.check_uneven_data and some_ended and some_have_more and not done:  # before a save of such a step
            self._uneven(trainer, *self._gather(trainer, self._flag.requested, batch_idx))
        # At any step, an epoch's last batch too: a resume continues there as the uninterrupted run
        # (tests/test_resume_positions.py).
        if requested:
            self._preempt(trainer, self._gather(trainer, self._flag.requested, batch_idx)[0])

    def _gather(self, trainer: pl.Trainer, requested: bool, batch_idx: int) -> tuple[list[int], list[list[int]]]:
        """Every rank's flags and batch counts, to name ranks on a path that stops the run (never a plain step)."""
        total = trainer.num_training_batches
        mine = torch.tensor([int(requested), int(bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)),
                             batch_idx + 1, -1 if total == float("inf") else int(total)], dtype=torch.int64,
                            device=trainer.strategy.root_device)
        everyone = [torch.empty_like(mine) for _ in range(trainer.world_size)]
        dist.all_gather(everyone, mine)
        rows = [row.tolist() for row in everyone]
        return [rank for rank, row in enumerate(rows) if row[0]], rows

    def _uneven(self, trainer: pl.Trainer, requested: list[int], rows: list[list[int]]) -> None:
        ended = [rank for rank, row in enumerate(rows) if row[1]]
        counts = ", ".join(f"rank {rank}: {'ran out after ' if row[1] else 'has more than '}{row[2]}"
                           + (f" of {row[3]}" if row[3] >= 0 else "") for rank, row in enumerate(rows))
        raise UnevenDataError(
            f"Uneven data across replicas in epoch {trainer.current_epoch}: ranks {ended} have no batch after"
            f" batch {rows[ended[0]][2]} while ranks {[r for r in range(len(rows)) if r not in ended]} have"
            f" more (batches per rank: {counts}). Every replica must get the same number of batches: use the"
            " DataLoader without a sampler of your own (the strategy adds a DistributedSampler that pads),"
            " or make each rank's data the same length (drop_last, equal shards).")

    def _preempt(self, trainer: pl.Trainer, requested: list[int]) -> None:
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        if trainer.global_rank == 0:
            names = self._flag.names()
            print(f"[lightning-4d] preempted ({names} on ranks {requested}): saved step {trainer.global_step}"
                  f" complete to {path}; every rank exits with status {EXIT_PREEMPTED}. Resume with"
                  " fit(ckpt_path='last').", file=sys.stderr, flush=True)
        raise Preempted(EXIT_PREEMPTED)

    def _compare_batch_shapes(self, trainer: pl.Trainer, batch: Any) -> None:
        strategy = trainer.strategy
        dims = getattr(strategy, "parallel_dims", None)
        if dims is None or not dist.is_initialized() or dims.pp * dims.cp * dims.tp == 1:
            return
        shapes = _tensor_shapes(batch)
        digest = int.from_bytes(hashlib.blake2b(repr(shapes).encode(), digest_size=7).digest(), "little")
        mine = torch.tensor([dims.coordinates(trainer.global_rank)["dp"], digest], dtype=torch.int64,
                            device=strategy.root_device)
        everyone = [torch.empty_like(mine) for _ in range(trainer.world_size)]
        dist.all_gather(everyone, mine)
        by_replica: dict[int, dict[int, list[int]]] = {}
        for rank, (dp, value) in enumerate(row.tolist() for row in everyone):
            by_replica.setdefault(dp, {}).setdefault(value, []).append(rank)
        split = {dp: groups for dp, groups in by_replica.items() if len(groups) > 1}
        if not split:
            return
        # Name the shapes: one more (rare) collective, only on the failing path.
        described: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(described, shapes)
        dp, groups = sorted(split.items())[0]
        parts = "; ".join(f"ranks {ranks}: {described[ranks[0]]}" for ranks in groups.values())
        raise BatchShapeMismatchError(
            f"Ranks of data-parallel replica {dp} (its pp, cp and tp peers, which must receive the same batch)"
            f" received batches of different shapes at step {trainer.global_step}: {parts}. Give every rank the"
            " same samples (the strategy's DistributedSampler does) and pad sequences to one length per batch on"
            " every rank (not to each rank's longest).")


def _tensor_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shapes of every tensor in a batch (nested dicts, lists, tuples), in a fixed order."""
    if isinstance(batch, Tensor):
        return [tuple(batch.shape)]
    if isinstance(batch, dict):
        return [shape for key in sorted(batch, key=str) for shape in _tensor_shapes(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [shape for item in batch for shape in _tensor_shapes(item)]
    return []


def _named_groups(trainer: pl.Trainer) -> dict[str, Any]:
    """The layout's process groups by name, for the collective recorder's table."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None or getattr(trainer.strategy, "mesh", None) is None:
        return {}
    names = ["dp", "pp", "cp", "tp", "dp_cp"] + (["pp_dp_cp"] if dims.pp_enabled else [])
    return {name: trainer.strategy.mesh.group(name) for name in names}


def _group(trainer: pl.Trainer, name: str) -> Optional[dist.ProcessGroup]:
    strategy = trainer.strategy
    if not dist.is_initialized() or not isinstance(getattr(strategy, "mesh", None), ParallelMesh):
        return None
    return strategy.mesh.group(name)


def broadcast_buffers(module: torch.nn.Module, group: Optional[dist.ProcessGroup],
                      versions: Optional[dict[int, int]] = None) -> None:
    """The buffers from the group's first rank to the others, one broadcast per dtype and device (DTensor
    buffers are skipped: their placements say how they are kept). With ``versions`` (kept by the caller across
    steps), only the buffers of modules whose buffers changed in place since they were last broadcast, as their
    version counters tell: every rank runs the same code on them, so every rank picks the same ones; a step that
    changed none (a model without BatchNorm, every step) broadcasts nothing, where DDP broadcasts every buffer
    every step."""
    if group is None or dist.get_world_size(group) < 2:
        return
    buffers: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    seen: set[int] = set()
    for owner in module.modules():
        # Skipped: DTensors, and stand-ins expanded from one value (a pipeline stage's parameters of others).
        own = [b for b in owner.buffers(recurse=False) if id(b) not in seen and not isinstance(b, DTensor)
               and b.numel() and not (b.numel() > 1 and 0 in b.stride())]
        seen.update(id(b) for b in own)
        # A module's buffers go together: batch_norm's kernel updates the running statistics without bumping
        # their version, but BatchNorm counts the batch in num_batches_tracked, which it bumps.
        if versions is None or any(versions.get(id(b)) != tensor_version(b) for b in own):
            for buffer in own:
                buffers.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    source = dist.get_global_rank(group, 0)
    for same in buffers.values():
        flat = torch.cat([b.detach().reshape(-1) for b in same])
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        with torch.no_grad():
            for buffer in same:
                buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
                if versions is not None:
                    versions[id(buffer)] = tensor_version(buffer)


def last_checkpoint_path(trainer: pl.Trainer) -> str:
    """Where a preemption checkpoint goes: ``last.ckpt`` of the first ModelCheckpoint (what
    ``fit(ckpt_path="last")`` finds), or ``<default_root_dir>/checkpoints/last.ckpt`` without one."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return str(Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}")
    return str(Path(trainer.default_root_dir) / "checkpoints" / f"last{ModelCheckpoint.FILE_EXTENSION}")


def attach(strategy: Any) -> None:
    """Add the default :class:`FaultTolerance` to the strategy's Trainer unless one is there already; first in
    the list, so a preemption saves before any ModelCheckpoint of the same step runs."""
    trainer = strategy.lightning_module.trainer
    if not any(isinstance(callback, FaultTolerance) for callback in trainer.callbacks):
        trainer.callbacks.insert(0, FaultTolerance())


def _nothing() -> None:
    """Nothing to put back."""
