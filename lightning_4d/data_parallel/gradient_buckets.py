"""Data parallelism: bucketed gradient all-reduce, overlapped with backward.

Why not ``DistributedDataParallel``: it refuses DTensor parameters (tensor parallelism), it reduces on every
backward unless wrapped in ``no_sync``, and pipeline stages produce gradients outside its forward. Here the
strategy decides when a backward is the last one before an optimizer step (Lightning's accumulation
micro-steps never are) and only then do the buckets send anything.

Each bucket holds parameters of one dtype and device. A bucket is launched as an asynchronous all-reduce the
moment its last gradient is accumulated, but never before the buckets ahead of it: every rank must issue
collectives in the same order. ``synchronize`` launches what is left, waits, and writes the mean back into
``.grad``. The first buckets follow reverse registration order; after the first synchronized backward they
are rebuilt in the order gradients actually arrived on the group's first rank (broadcast, so all ranks agree),
with parameters that got no gradient last, where they cannot hold back the buckets that are ready.

A parameter may have no gradient on some ranks (unused in that forward). Each bucket carries one count per
parameter, so the mean treats a missing gradient as zero and a parameter unused on every rank keeps
``grad=None``, as it would in a single process.

A bucket's flat buffer is allocated once and kept, as DDP keeps its buckets: a fresh buffer per step costs the
allocator (and on CPU the page faults) of a full gradient copy every step. Each gradient is copied into its
slice the moment it is ready and then *is* that slice (as DDP's ``gradient_as_bucket_view``): the tensor
autograd made is freed at once, and a gradient kept across ``zero_grad(set_to_none=False)`` or accumulation is
accumulated in place and needs no copy at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_MB = 25.0


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Bucket:
    params: list[Tensor]
    ready: set[int] = field(default_factory=set)  # slots whose gradient is already in the flat buffer
    flat: Optional[Tensor] = None  # every gradient, then one count per parameter; allocated once
    views: list[Tensor] = field(default_factory=list)  # each parameter's gradient inside ``flat``
    work: Optional[dist.Work] = None
    missing: list[int] = field(default_factory=list)  # slots without a gradient on this rank at launch

    def allocate(self) -> None:
        if self.flat is not None:
            return
        shapes = [_local(p) for p in self.params]
        sizes = [t.numel() for t in shapes]
        self.flat = shapes[0].new_empty(sum(sizes) + len(sizes))
        pieces = self.flat[:sum(sizes)].split(sizes)
        self.views = [piece.view_as(t) for piece, t in zip(pieces, shapes)]


def _as_grad_of(param: Tensor, local: Tensor) -> Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride())
    return local


class GradientBuckets:
    """Averages the gradients of ``params`` over ``group``; one instance per optimizer."""

    def __init__(self, params: Iterable[Tensor], group: dist.ProcessGroup, bucket_mb: float = DEFAULT_BUCKET_MB):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be positive (megabytes per gradient bucket, default 25).")
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.params = list({id(p): p for p in params if p.requires_grad}.values())
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self._cap_bytes = int(bucket_mb * 2**20)
        self._set_order(list(reversed(range(len(self.params)))))
        self._arrivals: Optional[list[int]] = [] if self.group_size > 1 else None
        self._next = 0
        self.overlap = False
        self.synchronized = False
        # Alone in the group there is nothing to reduce: no hook runs per parameter per backward.
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params
                       ] if self.group_size > 1 else []

    def _set_order(self, order: list[int]) -> None:
        self.order = order
        self.buckets = _fill_buckets([self.params[i] for i in order], self._cap_bytes)
        self._slot = {id(p): (i, slot) for i, b in enumerate(self.buckets) for slot, p in enumerate(b.params)}

    def begin(self, overlap: bool = True) -> None:
        """Arm the buckets: the coming backward is the last before an optimizer step. ``overlap=False``: reduce
        nothing during backward, all of it in ``synchronize`` (a pipeline schedule runs several backwards)."""
        self._reset()
        self.overlap = overlap

    def _on_grad_ready(self, param: Tensor) -> None:
        if not self.overlap:
            return
        index, slot = self._slot[id(param)]
        bucket = self.buckets[index]
        if bucket.work is not None:
            raise RuntimeError(
                "A gradient changed after its bucket was all-reduced: backward ran twice before one optimizer"
                " step. Call backward once per optimizer step, or use accumulate_grad_batches."
            )
        bucket.allocate()
        self._adopt(param, bucket, slot)  # again if it fires again (a reentrant checkpoint): a no-op or a copy
        if self._arrivals is not None:
            self._arrivals.append(self._position[id(param)])
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
            self.buckets[self._next].params
        ):
            self._launch(self.buckets[self._next])
            self._next += 1

    @staticmethod
    def _adopt(param: Tensor, bucket: _Bucket, slot: int) -> None:
        """The gradient moves into its slice of the bucket and from now on is that slice."""
        view, local = bucket.views[slot], _local(param.grad)
        if local.data_ptr() != view.data_ptr():
            view.copy_(local)
            param.grad = _as_grad_of(param, view)
        bucket.ready.add(slot)

    def _launch(self, bucket: _Bucket) -> None:
        """The counts are written on the device (no tensor built from host data): one per parameter, 1 where this
        rank has its gradient, 0 where it has none (then its slice is zeros)."""
        bucket.allocate()
        counts = bucket.flat[-len(bucket.params):]
        counts.fill_(1.0)
        bucket.missing = []
        for slot, p in enumerate(bucket.params):
            if slot not in bucket.ready:
                if p.grad is None:
                    bucket.views[slot].zero_()
                    counts[slot].zero_()
                    bucket.missing.append(slot)
                    continue
                self._adopt(p, bucket, slot)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def synchronize(self) -> None:
        """Finish the reduction for this optimizer step; a no-op if it already happened since ``begin``."""
        after_armed_backward, self.overlap = self.overlap, False
        if self.synchronized:
            return
        self.synchronized = True
        if self.group_size == 1:
            return
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)
        for bucket in self.buckets:
            bucket.work.wait()
            self._finish(bucket)
        self._reset(keep_synchronized=True)
        if after_armed_backward and self._arrivals is not None:
            self._rebuild_in_arrival_order()

    def _rebuild_in_arrival_order(self) -> None:
        arrived = list(dict.fromkeys(self._arrivals))
        seen = set(arrived)
        order = torch.tensor(arrived + [i for i in self.order if i not in seen])
        dist.broadcast(order, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._set_order(order.tolist())
        self._arrivals = None

    def _finish(self, bucket: _Bucket) -> None:
        """The sums become means in place; so do the gradients, which are views of the bucket. Only a parameter
        without a gradient on this rank needs the counts read on the host (a gradient elsewhere: it gets the mean
        of the others; none anywhere: it keeps ``grad=None``, as one process would); when every gradient is here,
        nothing is read back."""
        bucket.flat.div_(self.group_size)
        if not bucket.missing:
            return
        counts = bucket.flat[-len(bucket.params):]
        for slot, count in zip(bucket.missing, counts[bucket.missing].tolist()):
            if count:
                p = bucket.params[slot]
                p.grad = _as_grad_of(p, bucket.views[slot])

    def _reset(self, keep_synchronized: bool = False) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
        self._next = 0
        self.synchronized = keep_synchronized

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _fill_buckets(params: Iterable[Tensor], cap_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    open_buckets: dict[tuple, tuple[_Bucket, int]] = {}
    for p in params:
        local = _local(p)
        key = (local.dtype, local.device)
        size = local.numel() * local.element_size()
        bucket, used = open_buckets.get(key, (None, 0))
        if bucket is None or used + size > cap_bytes:
            bucket, used = _Bucket(params=[]), 0
            buckets.append(bucket)
        bucket.params.append(p)
        open_buckets[key] = (bucket, used + size)
    return buckets


class BucketSets:
    """Several sets of gradient buckets (over different groups) armed and synchronized as one."""

    def __init__(self, sets: list[GradientBuckets]) -> None:
        self.sets = sets

    @property
    def buckets(self) -> list[_Bucket]:
        """Every set's buckets, in order."""
        return [bucket for buckets in self.sets for bucket in buckets.buckets]

    def begin(self, overlap: bool = True) -> None:
        for buckets in self.sets:
            buckets.begin(overlap)

    def synchronize(self) -> None:
        for buckets in self.sets:
            buckets.synchronize()

    def remove(self) -> None:
        for buckets in self.sets:
            buckets.remove()
