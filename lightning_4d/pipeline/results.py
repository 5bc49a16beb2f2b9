"""The last stage's step results (its output, logs, metric updates and token count) on every stage, without
making a GPU wait for the host.

Only the last stage ran the whole step; every stage must return its output and replay its logs. The values
are device tensors and travel as such: one broadcast per dtype over the pipeline group, into tensors the
receivers allocate on their device. What the receivers need on the host to allocate and rebuild them (the
nesting, the names, ``self.log``'s options, the shapes and dtypes) is the step's *structure*; it goes through
the store, where the last stage writes it for each step and every other stage reads it: the bytes only when it
changed since the step before (the first step, a name logged in some steps only), an empty value otherwise.
Reading a key is a round trip to the store, on the host alone: no device read, no object collective. Without
a store (a process group started without one) the results travel as before, by ``broadcast_object_list``.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_4d import _compat as compat
from lightning_4d.parallel_dims import run_scoped_store

# A receiver may read a step's key this many steps after the last stage wrote it before the key is deleted (a
# GPU's launch queue keeps every host within a step or two of the others).
_KEPT_STEPS = 64


class _Slot(NamedTuple):
    """A tensor's place in the structure: its index among the step's tensors, shape and dtype."""
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class ResultExchange:
    """Moves one step's results from ``source`` (the last stage's global rank) to the other ranks of ``group``."""

    _created = 0  # per process; every rank makes its runners in the same order, so the n-th has one id everywhere

    def __init__(self, group: dist.ProcessGroup, source: int, device: torch.device) -> None:
        ResultExchange._created += 1
        self.group, self.source, self.device = group, source, device
        self.is_source = dist.get_rank() == source
        self.store = compat.default_store()
        self._scoped = False  # under this run's name from the first exchange on (after the ranks' first barrier)
        self._prefix = f"lightning_4d/pipeline_results/{ResultExchange._created}/{source}/"
        self._step = 0
        self._structure: Any = None  # the last structure sent (as bytes on the source, as objects elsewhere)
        self._sending: list[tuple[Any, Tensor]] = []  # the source's broadcasts in flight, and their buffers

    def exchange(self, local: Any) -> Any:
        """``local`` (the step's results) on the source, anything elsewhere; every rank gets the source's."""
        if self.store is None:
            return self._as_objects(local)
        if not self._scoped:  # a restarted job's store still holds the attempt before's keys of the same steps
            self.store, self._scoped = run_scoped_store(self.store), True
        self._step += 1
        key = f"{self._prefix}{self._step}"
        if self.is_source:
            tensors: list[Tensor] = []
            structure = apply_to_collection(local, Tensor, self._slot, tensors)
            blob = pickle.dumps(structure)
            self.store.set(key, b"" if blob == self._structure else blob)
            self._structure = blob
            if self._step > _KEPT_STEPS:
                self.store.delete_key(f"{self._prefix}{self._step - _KEPT_STEPS}")
            self.finish_sending()
            for dtype in dict.fromkeys(t.dtype for t in tensors):  # one broadcast per dtype, in first-seen order
                flat = torch.cat([t.reshape(-1) for t in tensors if t.dtype == dtype])
                self._sending.append((dist.broadcast(flat, src=self.source, group=self.group, async_op=True), flat))
            return local
        blob = self.store.get(key)
        if blob:
            self._structure = pickle.loads(blob)
        slots: list[_Slot] = []
        apply_to_collection(self._structure, _Slot, slots.append)
        slots.sort()
        received: dict[int, Tensor] = {}
        for dtype in dict.fromkeys(slot.dtype for slot in slots):
            same = [slot for slot in slots if slot.dtype == dtype]
            sizes = [_numel(slot.shape) for slot in same]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            dist.broadcast(flat, src=self.source, group=self.group, async_op=True).wait()
            for slot, part in zip(same, flat.split(sizes)):
                received[slot.index] = part.view(slot.shape)
        return apply_to_collection(self._structure, _Slot, lambda slot: received[slot.index])

    def finish_sending(self) -> None:
        """Wait for the source's broadcasts of the step before. The source already holds its results, so it does
        not wait for the others to receive them when it sends (that would hold it until the last of them
        reached the end of its schedule); it waits here, a step later, or before the process group goes."""
        while self._sending:
            work, _ = self._sending.pop(0)
            work.wait()

    def _slot(self, tensor: Tensor, tensors: list[Tensor]) -> _Slot:
        tensors.append(tensor.detach().to(self.device))  # a value logged on the host travels from the device too
        return _Slot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype)

    def _as_objects(self, local: Any) -> Any:
        payload: list[Any] = [apply_to_collection(local, Tensor, Tensor.cpu) if self.is_source else None]
        dist.broadcast_object_list(payload, src=self.source, group=self.group)
        return local if self.is_source else apply_to_collection(payload[0], Tensor, Tensor.to, self.device)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
