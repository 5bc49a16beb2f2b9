"""Checkpoint saves that never stop training, and are never written twice.

:class:`CheckpointWriter` is where the strategy sends Lightning's saves, removals and links.

- **Synchronous** (the default): a save returns when the checkpoint is complete under its name (:func:`.sharded.save`).
- **Asynchronous** (``FourDStrategy(async_save=True)``, or Lightning's ``AsyncCheckpointIO`` plugin): the step waits
  only while each rank copies what it holds into host memory shared with its writer process, allocated on the
  first save and reused (pinned on CUDA). A thread then saves with DCP over a process group of its own (the
  training thread's collectives never queue behind it): it plans, the writer process writes the shard files
  (:mod:`.writer_process`: serializing takes the GIL, so not in the training process) and checksums them, and
  the thread gathers the checksums to rank 0, which renames the ``.partial`` directory into place. DCP's last
  step gathers every rank's write result to rank 0, so the rename comes after every rank's files are written,
  and no training step waits for that agreement. At most one save is in flight: the next one waits for it, and
  rank 0 says so once.
- **Nothing visible early**: Lightning's ``ModelCheckpoint`` removes superseded top-k checkpoints and links ``last``
  right after a save returns. While a save is in flight those wait for it and run, in order, once it is in place;
  links and copies before removals. A crash at any point leaves the previous complete checkpoint the newest one.
- **Not twice**: a save of exactly what the previous save holds (``save_last=True`` right after a top-k save of the
  same step: no tensor changed in between, and every rank agrees) hard-links the previous directory's shard files
  and writes only its own ``meta.pt``.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_4d import _compat as compat
from lightning_4d.checkpoint import sharded
from lightning_4d.checkpoint.writer_process import WRITER_NICENESS, ProcessFileWriter, SharedBlock, WriterProcess


def check_async_save(async_save: Any) -> bool:
    """``FourDStrategy(async_save=...)`` checked when the strategy is made, before any process starts."""
    if not isinstance(async_save, bool):
        raise ValueError(f"async_save={async_save!r}: use True (saves write in the background) or False.")
    return async_save


def honored_checkpoint_io(checkpoint_io: Any) -> bool:
    """Whether the Trainer's checkpoint IO plugin asks for asynchronous saves (Lightning's ``AsyncCheckpointIO``
    around its default IO). Any other plugin the strategy cannot honor, since it writes DCP shards itself, is
    refused here, at Trainer construction, instead of being silently ignored."""
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    inner = checkpoint_io.checkpoint_io if isinstance(checkpoint_io, AsyncCheckpointIO) else checkpoint_io
    if inner is not None and type(inner) is not TorchCheckpointIO:
        raise ValueError(
            f"Trainer(plugins=[{type(checkpoint_io).__name__}(...)]): FourDStrategy writes its checkpoints as sharded"
            f" torch.distributed.checkpoint directories itself and cannot save through {type(inner).__name__}."
            " Remove the plugin; for saves that do not stop training use FourDStrategy(async_save=True) or"
            " Trainer(plugins=[AsyncCheckpointIO()]).")
    return isinstance(checkpoint_io, AsyncCheckpointIO)


class HostStaging:
    """Host copies of one rank's checkpoint tensors, in one block of memory shared with the writer process.
    Allocated on the first save (pinned on CUDA) and reused while the tensors keep their names, shapes and
    placements, so staging costs one copy, not an allocation, per save."""

    def __init__(self, process: WriterProcess, pin_memory: bool) -> None:
        self.process, self.pin_memory = process, pin_memory
        self.block: Optional[SharedBlock] = None
        self.buffers: Optional[dict[str, Any]] = None
        self._layout: Optional[list[tuple]] = None
        self.allocations = 0

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        layout = _layout(tensors)
        if layout != self._layout:
            self._release()  # the old block goes before the new one comes
            self.block = SharedBlock(SharedBlock.bytes_for(
                [_local(value) for _, value in _leaves(tensors) if isinstance(value, torch.Tensor)]), self.pin_memory)
            self.buffers, self._layout = _carve(tensors, self.block), layout
            self.process.share(self.block)
            self.allocations += 1
        staged = compat.copy_state_dict(tensors, self.buffers, non_blocking=self.pin_memory)
        if self.pin_memory:
            torch.cuda.current_stream().synchronize()  # the copies are done before the step goes on
        return staged

    def _release(self) -> None:
        if self.block is not None:
            self.buffers, self._layout = None, None
            self.block.close()
            self.block = None


def _yield_cpu_to_training() -> None:
    """The coordinating thread (plans, gathers, checksums) at nice +10. Not in the idle class as the writer
    process: it takes the GIL, and a starved thread holding it would stall training. Linux schedules threads,
    and nice is per thread."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        with contextlib.suppress(OSError):  # a platform where nice is per process: it just runs as is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICENESS))


def _carve(tree: Any, block: SharedBlock) -> Any:
    """``tree`` with each tensor replaced by a view of ``block`` of its (local) shape; a DTensor keeps its mesh
    and placements, so that DCP plans the staged copy as it plans the original."""
    if isinstance(tree, dict):
        return {key: _carve(value, block) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_carve(value, block) for value in tree)
    if isinstance(tree, DTensor):
        local = block.view(tree.to_local().shape, tree.dtype)
        return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape,
                                  stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return block.view(tree.shape, tree.dtype)
    return tree


def _leaves(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{index}.")
    else:
        yield prefix, tree


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _layout(tensors: dict[str, Any]) -> list[tuple]:
    return [(key, tuple(value.shape), value.dtype, tuple(_local(value).shape),
             getattr(value, "placements", None)) for key, value in _leaves(tensors) if isinstance(value, torch.Tensor)]


def _fingerprint(tensors: dict[str, Any]) -> list[tuple]:
    """What identifies a save's contents without reading them: each tensor's memory and in-place version (every
    optimizer step and every ``copy_`` bumps it), and every other value (learning rates) as it is."""
    return [(key, _local(value).data_ptr(), compat.tensor_version(_local(value)))
            if isinstance(value, torch.Tensor) else (key, repr(value)) for key, value in _leaves(tensors)]


@dataclass
class _Flight:
    """One save being written in the background, and what waits for it to be in place (rank 0's)."""

    path: Path
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None
    published: bool = False
    waiting: list[Callable[[], None]] = field(default_factory=list)
    removals: list[Path] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def after(self, action: Optional[Callable[[], None]] = None, removal: Optional[Path] = None) -> bool:
        """Queue ``action`` or ``removal`` behind the save; False when it is already in place (do it now)."""
        with self.lock:
            if self.published:
                return False
            self.waiting += [action] if action else []
            self.removals += [removal] if removal else []
            return True

    def run_waiting(self) -> None:
        """Links and copies first, then removals: a removed checkpoint is never the newest complete one."""
        while True:
            with self.lock:
                actions, removals = self.waiting, self.removals
                self.waiting, self.removals = [], []
                if not actions and not removals:
                    self.published = True
                    return
            for action in actions:
                action()
            for path in removals:
                sharded.remove(path)


@dataclass
class _Saved:
    path: Path
    fingerprint: list[tuple]
    tensors: dict[str, Any]  # held so that no tensor it names is freed and its memory reused by another


class CheckpointWriter:
    """Lightning's saves, removals and links for one strategy (see the module doc). ``agree(bool)``: a collective
    that is True when it is True on every rank; ``group``: the background writer's process group (asynchronous)."""

    def __init__(self, asynchronous: bool, is_writer: bool, agree: Callable[[bool], bool],
                 group: Optional[dist.ProcessGroup] = None, pin_memory: bool = False) -> None:
        self.asynchronous, self.is_writer, self.agree, self.group = asynchronous, is_writer, agree, group
        self.process = WriterProcess() if asynchronous else None
        self.staging = HostStaging(self.process, pin_memory) if asynchronous else None
        self._flight: Optional[_Flight] = None
        self._saved: Optional[_Saved] = None
        self._abandoned = False
        self._said_waited = False
        self.blocked_seconds: list[float] = []  # per save, how long the caller waited (benchmarks read it)
        if asynchronous:
            _LIVE.add(self)  # a save after fit is complete before the process leaves

    @classmethod
    def for_strategy(cls, strategy: Any) -> "CheckpointWriter":
        """A strategy's writer (every rank makes it, after the process groups): asynchronous over several processes,
        it writes over a gloo group of its own, so that training's collectives never queue behind it."""
        group = dist.new_group(backend="gloo") if strategy.async_save and dist.get_world_size() > 1 else None
        return cls(strategy.async_save, strategy.global_rank == 0, strategy.reduce_boolean_decision, group,
                   pin_memory=strategy.root_device.type == "cuda")

    def route_links(self, callbacks: list[Any], barrier: Callable[[], None]) -> None:
        """ModelCheckpoint's ``save_last="link"`` through :meth:`link`, then ``barrier``, as Lightning's link does."""
        def link(trainer: Any, target: str, path: str) -> None:
            self.link(target, path)
            barrier()

        compat.route_checkpoint_links(callbacks, link)

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        """Collective: every rank calls it with the same ``path``."""
        started = time.perf_counter()
        path = Path(path)
        tensors, meta = sharded.split(checkpoint)
        fingerprint = _fingerprint(tensors)
        same = self.agree(self._saved is not None and self._saved.fingerprint == fingerprint
                          and self._saved.path != path)
        if same:
            source = self._saved.path
            if self.is_writer:
                meta = copy.deepcopy(meta)
                self._when_in_place(lambda: sharded.publish_copy(source, path, meta))
        elif self.asynchronous:
            self._launch(tensors, meta, path)
        else:
            sharded.save(checkpoint, path, self.is_writer)
        self._saved = _Saved(path, fingerprint, tensors)
        self.blocked_seconds.append(time.perf_counter() - started)

    def link(self, target: str, path: str) -> None:
        """ModelCheckpoint's ``save_last="link"`` (rank 0's part): ``path`` points at ``target`` once it is complete."""
        if self.is_writer:
            self._when_in_place(lambda: sharded.publish_symlink(Path(target), Path(path)))

    def remove(self, path: str) -> None:
        """A superseded checkpoint (rank 0's part), removed once the save in flight is in place."""
        if self.is_writer and not (self._flight is not None and self._flight.after(removal=Path(path))):
            sharded.remove(path)
        if self._saved is not None and self._saved.path == Path(path):
            self._saved = None  # nothing to link to any more

    def _when_in_place(self, action: Callable[[], None]) -> None:
        if not (self._flight is not None and self._flight.after(action)):
            action()

    def _launch(self, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
        self.wait(say=True)
        staged = self.staging.stage(tensors)
        meta = copy.deepcopy(meta) if self.is_writer else {}
        flight = self._flight = _Flight(path)
        flight.thread = threading.Thread(target=self._write, args=(flight, staged, meta), daemon=True,
                                         name="lightning-4d checkpoint writer")
        flight.thread.start()

    def _write(self, flight: _Flight, staged: dict[str, Any], meta: dict[str, Any]) -> None:
        _yield_cpu_to_training()
        try:
            partial = sharded.partial_path(flight.path)
            if self.is_writer:
                sharded.remove(partial)  # an interrupted save's leftover, gone before any rank writes there
            if dist.is_initialized():
                dist.barrier(group=self.group)
            sharded.write(staged, meta, partial, self.is_writer, self.group,
                          storage_writer=ProcessFileWriter(partial, self.process))
            if self.is_writer:
                sharded.publish(partial, flight.path)
                flight.run_waiting()
        except BaseException as error:  # noqa: BLE001  raised on the training thread (raise_if_failed, wait)
            flight.error = error

    def raise_if_failed(self) -> None:
        """A background write that failed fails the run at the next step (a host check, no collective)."""
        if self._flight is not None and self._flight.error is not None:
            self.wait()

    def wait(self, say: bool = False) -> None:
        """Until the save in flight is in place; its error, if it failed, is raised here. ``say``: rank 0 says
        (once per run) that a new save had to wait for the previous one."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        started = time.perf_counter()
        flight.thread.join()
        if flight.error is not None:
            raise RuntimeError(f"Writing the checkpoint {flight.path} in the background failed on rank"
                               f" {dist.get_rank() if dist.is_initialized() else 0}: {flight.error!r}. The previous"
                               " complete checkpoint is the newest one.") from flight.error
        waited = time.perf_counter() - started
        if say and waited > 0.01 and self.is_writer and not self._said_waited:
            self._said_waited = True
            print(f"[lightning-4d] a checkpoint save waited {waited:.1f} s for the previous one ({flight.path.name}) to"
                  " finish writing: at most one save is in flight. Checkpoint less often to train without waiting"
                  " (said once).", file=sys.stderr, flush=True)

    def abandon(self) -> None:
        """The run failed: a save in flight may wait on a rank that is gone, so nobody waits for it (its
        ``.partial`` directory stays behind and is never mistaken for a checkpoint)."""
        self._abandoned = True

    def finish(self) -> None:
        """The end of a fit, or of the process: the save in flight is in place before it ends."""
        if not self._abandoned:
            self.wait()


_LIVE: "weakref.WeakSet[CheckpointWriter]" = weakref.WeakSet()


@atexit.register
def _finish_every_writer() -> None:
    for writer in list(_LIVE):
        writer.finish()
        writer.process.close()
