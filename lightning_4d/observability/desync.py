"""Opt-in desync detection (``FourDStrategy(debug=True)``): find where ranks silently disagree.

Three things must agree for a parallel run to train the single-process model, and none of them fails
loudly when it does not:

* every rank of one data-parallel replica (the same ``dp`` coordinate) receives the same batch;
* a tensor that is meant to be replicated is bit-identical wherever it lives (plain parameters on every
  rank of a pipeline stage, DTensor shards across the dp and cp ranks that hold the same shard);
* every rank issues the same sequence of collectives on each group it shares with others; otherwise
  they pair up wrong and hang or mix unrelated tensors.

The tensor checks gather small fingerprints (two float64 sums per tensor, and shapes) and raise
:class:`DesyncError` on every rank of the group, naming the first difference by rank and tensor name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_4d import _compat as compat
from lightning_4d.parallel_dims import ParallelMesh, run_scoped_store

# Group collectives only: point-to-point calls legitimately differ between the two ends.
_TRACED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
           "broadcast", "all_to_all_single", "barrier", "broadcast_object_list", "all_gather_object")


class DesyncError(RuntimeError):
    """Ranks that must agree do not; the message names the ranks and the first tensor or call that differs."""


def fingerprint(tensor: Tensor) -> tuple[float, float]:
    """Two numbers that change when any element changes (not a cryptographic hash: a debugging aid)."""
    data = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().double()
    weights = torch.arange(1, data.numel() + 1, dtype=torch.float64, device=data.device).reshape(data.shape)
    return float(data.sum()), float((data * weights).sum())


def _first_mismatch(fingerprints: dict[str, Any], group: dist.ProcessGroup) -> Optional[str]:
    """Collective over ``group``: the first entry whose fingerprint differs between its ranks, described."""
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, fingerprints, group=group)
    ranks = dist.get_process_group_ranks(group)
    reference = per_rank[0]
    for rank, fingerprints in zip(ranks[1:], per_rank[1:]):
        for name in reference:
            if fingerprints.get(name) != reference[name]:
                return f"{name!r} differs between rank {ranks[0]} and rank {rank}"
        extra = sorted(set(fingerprints) - set(reference))
        if extra:
            return f"rank {rank} has {extra[0]!r}, rank {ranks[0]} has not"
    return None


def check_batch(batch: Any, replica_group: dist.ProcessGroup) -> None:
    """All ranks of ``replica_group`` (one data-parallel replica) must hold the same batch."""
    leaves, _ = compat.tree_flatten_with_path(batch)
    fingerprints = {compat.keystr(path) or "batch": (tuple(leaf.shape), fingerprint(leaf))
                    for path, leaf in leaves if isinstance(leaf, Tensor)}
    problem = _first_mismatch(fingerprints, replica_group)
    if problem:
        raise DesyncError(
            f"Ranks of one data-parallel replica received different batches: batch entry {problem}."
            " Ranks that share a dp coordinate (pp, cp and tp peers) must see the same samples: use the"
            " strategy's DistributedSampler (do not shard data by global rank yourself) and seed any"
            " random augmentation identically."
        )


def check_replicas(module: nn.Module, groups: dict[str, dist.ProcessGroup]) -> None:
    """Parameters and buffers meant to be replicated over ``groups[name]`` must be bit-identical there.

    ``groups`` maps a label to a group whose ranks should hold identical copies of every plain tensor; DTensor
    shards are compared over the groups labelled ``shards`` only (other ranks hold other shards).
    """
    named = dict(module.named_parameters())
    named.update(module.named_buffers())
    every = {name: fingerprint(t) for name, t in named.items()}
    plain = {name: value for name, value in every.items() if not isinstance(named[name], DTensor)}
    for label, group in groups.items():
        fingerprints = every if label == "shards" else plain
        problem = _first_mismatch(fingerprints, group)
        if problem:
            ranks = dist.get_process_group_ranks(group)
            raise DesyncError(
                f"Replicated weights diverged ({label} group {ranks}): {problem}. Something changed weights on"
                " one rank only (an in-place edit in a hook, a rank-dependent init, a skipped gradient sync)."
            )


class CollectiveTrace:
    """Checks, before each collective runs, that every member of its group is issuing the same call.

    Divergent collectives do not fail cleanly: gloo aborts on a size mismatch, NCCL hangs. So the check
    happens first, through the rendezvous store (a side channel that cannot mix with the collectives): each
    rank posts ``(op, shape)`` under the group and the call's sequence number on it, then reads its peers'.
    """

    def __init__(self, store: dist.Store, timeout: timedelta = timedelta(seconds=60), prefix: str = "desync") -> None:
        self.store, self.timeout, self.prefix = store, timeout, prefix
        self._scoped = False  # under this run's name from the first check on (after the ranks' first barrier)
        self._sequence: dict[tuple[int, ...], int] = {}

    def _check(self, name: str, ranks: tuple[int, ...], shape: str) -> None:
        if not self._scoped:  # a restarted job's store still holds the attempt before's calls of the same numbers
            self.store, self._scoped = run_scoped_store(self.store), True
        index = self._sequence.get(ranks, 0)
        self._sequence[ranks] = index + 1
        me = dist.get_rank()
        key = f"{self.prefix}/{','.join(map(str, ranks))}/{index}/"
        self.store.set(key + str(me), f"{name} {shape}")
        mine = f"{name} {shape}"
        for peer in ranks:
            if peer == me:
                continue
            try:
                self.store.wait([key + str(peer)], self.timeout)
            except dist.DistNetworkError:  # the store's host is gone: a lost rank, not a different code path
                raise
            except RuntimeError as error:  # the wait timed out (DistStoreError; a FileStore's plain RuntimeError)
                raise DesyncError(
                    f"Rank {me} issued {mine} as call {index} on group {list(ranks)}, and rank {peer} issued no"
                    f" call {index} on that group within {self.timeout}: ranks took different code paths."
                ) from error
            theirs = self.store.get(key + str(peer)).decode()
            if theirs != mine:
                raise DesyncError(
                    f"Collective sequences differ on group {list(ranks)} at call {index}: rank {me} issued {mine},"
                    f" rank {peer} issued {theirs}. Ranks that take different code paths (a data-dependent branch,"
                    " a rank-dependent `if`) hang or mix unrelated tensors."
                )

    @contextmanager
    def recording(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in _TRACED if hasattr(dist, name)}

        def traced(name: str, original: Any, signature: inspect.Signature, *args: Any, **kwargs: Any) -> Any:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
            first = args[0] if args else None
            shape = str(tuple(first.shape)) if isinstance(first, Tensor) else type(first).__name__
            self._check(name, ranks, shape)
            return original(*args, **kwargs)

        for name, original in originals.items():
            setattr(dist, name, functools.partial(traced, name, original, inspect.signature(original)))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


class DesyncMonitor:
    """The three checks over the first ``steps`` training steps of a layout (``FourDStrategy(debug=True)``).

    Batches are compared within each data-parallel replica (ranks with one dp coordinate) before context
    parallelism shards them; plain weights within each pipeline stage and DTensor shards within each
    ``dp_cp`` group (``dp_replicate`` under sharded data parallelism), at the start of each checked step (so after the previous optimizer step); and every
    collective of the checked steps is compared with its group before it runs.
    """

    def __init__(self, mesh: ParallelMesh, steps: int = 2, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.steps = steps
        self.replica = mesh.group("replica")
        self.stage = mesh.group("stage")
        # Ranks that hold the same DTensor shards: a tensor-parallel shard is the same on every dp x cp rank;
        # FSDP's shards differ over dp_shard x cp and are copies over the replicas only.
        self.shards = mesh.group("dp_replicate" if mesh.dims.dp_shard_enabled else "dp_cp")
        self._trace = CollectiveTrace(compat.default_store(), timeout)
        self._recording: Optional[Any] = None

    def check_batch(self, batch: Any, step: int) -> None:
        if step < self.steps:
            check_batch(batch, self.replica)

    def on_step_start(self, module: nn.Module, step: int) -> None:
        """Weights as the previous step left them; collectives of this step are traced while it is checked."""
        self.stop_tracing()
        if step <= self.steps:
            check_replicas(module, {"stage": self.stage, "shards": self.shards})
        if step < self.steps:
            self._recording = self._trace.recording()
            self._recording.__enter__()

    def stop_tracing(self) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
