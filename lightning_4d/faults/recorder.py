"""An always-on collective flight recorder: what each rank last asked of its process groups.

Every collective and point-to-point call a rank makes through a process group is recorded before it starts,
in a ring of the last :data:`RING_SIZE` records held in memory: the operation, the group (by the layout's
name, ``tp``, ``dp_cp``, ``pp``, ..., or ``world``, with its ranks), the call's sequence number on that group
(counted by this rank from the start of the process), the shape of its first tensor, the training step and
hook the rank was in (from the fault callback's progress marks), and whether the call has completed. The
heartbeat thread publishes the latest record with each heartbeat (:mod:`.liveness`), so when a collective
fails or times out, or liveness ends the job, every rank prints a table of what every rank was last doing,
and ranks that issued different collectives stand out: ``all_reduce #12 on dp_cp`` on one rank against
``broadcast #11 on world`` on another.

What is recorded (see ``docs/troubleshooting.md``):

* every call through a ``torch.distributed.ProcessGroup`` method made from Python: ``torch.distributed``'s
  collectives and point-to-point calls, so the gradient buckets, ``torch.distributed.pipelining``'s sends and
  receives, ring attention, checkpoint saves and loads, and Lightning's ``reduce``/``broadcast``/``barrier``
  (``self.log(sync_dist=True)``); completion is seen when ``Work.wait()`` returns;
* torch's functional collectives called through ``torch.distributed._functional_collectives`` (what DTensor
  uses for tensor parallelism's redistributions), as issued: they complete asynchronously in C++, so they are
  never marked done.

Collectives that C++ issues without passing through either (NCCL's own communicator set-up, compiled
graphs) are not seen; NCCL's own flight recorder covers those (``TORCH_NCCL_TRACE_BUFFER_SIZE``).

The cost is a Python call, a dict look-up and a short list per collective (``bench/recorder.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_4d import _compat as compat

RING_SIZE = 64

# Positions in a record (a list, cheap to build on the training thread).
_SEQ, _OP, _GROUP, _SHAPE, _STEP, _DOING, _STATE = range(7)


class CollectiveRecorder:
    """This process's ring of collective records (one per process: :data:`RECORDER`)."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.ring: deque[list[Any]] = deque(maxlen=size)
        self.step, self.doing = -1, "starting"
        self._labels: dict[int, str] = {}  # id(process group) -> its label
        self._names: dict[int, list[str]] = {}  # id(process group) -> the layout's names for it
        self._groups: list[Any] = []  # keeps the named groups alive, so their ids stay theirs
        self._sequence: dict[int, int] = {}
        self._pending: dict[int, list[Any]] = {}  # id(Work) -> its record, until waited on

    def where(self, doing: str, step: int) -> None:
        """The training thread reached ``doing`` of ``step`` (set with the heartbeat's progress marks)."""
        self.doing, self.step = doing, step

    def name_groups(self, groups: dict[str, Any]) -> None:
        """The layout's names for its process groups (a group may have several: ``dp`` may be the world)."""
        for name, group in groups.items():
            if group is None:
                continue
            self._groups.append(group)
            names = self._names.setdefault(id(group), [])
            if name not in names:
                names.append(name)
            self._labels.pop(id(group), None)

    def forget_groups(self) -> None:
        """Let go of the layout's process groups (before they are destroyed at exit): held here, they would
        outlive their destruction until the interpreter finalizes."""
        self._groups.clear()
        self._names.clear()
        self._labels.clear()

    def label(self, group: Any) -> str:
        key = id(group)
        label = self._labels.get(key)
        if label is None:
            label = self._labels[key] = self._describe(group)
        return label

    def _describe(self, group: Any) -> str:
        if isinstance(group, str):
            return group
        names = list(self._names.get(id(group), []))
        try:
            if group is dist.group.WORLD and "world" not in names:
                names.insert(0, "world")
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError, AttributeError):
            return "/".join(names) or "a group"
        listed = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]},...,{ranks[-1]}"
        return f"{'/'.join(names) or 'group'}[{listed}]"

    def add(self, op: str, group: Any, args: tuple, peer: Optional[int] = None) -> list[Any]:
        key = id(group)
        seq = self._sequence.get(key, 0) + 1
        self._sequence[key] = seq
        record = [seq, op if peer is None else f"{op}({peer})", self.label(group), _shape(args), self.step,
                  self.doing, "waiting"]
        self.ring.append(record)
        return record

    def started(self, work: Any, record: list[Any]) -> None:
        if len(self._pending) > 4096:  # works never waited on (fire and forget): forget the oldest
            self._pending.pop(next(iter(self._pending)))
        self._pending[id(work)] = record

    def finished(self, work: Any) -> None:
        record = self._pending.pop(id(work), None)
        if record is not None:
            record[_STATE] = "done"

    def last(self, count: int = 1) -> list[dict[str, Any]]:
        """The newest ``count`` records, oldest first, as plain dicts (what the heartbeat publishes)."""
        records = list(self.ring)[-count:]
        return [dict(zip(("seq", "op", "group", "shape", "step", "doing", "state"), record)) for record in records]


def describe(record: Optional[dict[str, Any]]) -> str:
    """One record as the failure table prints it."""
    if not record:
        return "none yet"
    shape = f" {record['shape']}" if record["shape"] else ""
    return (f"{record['op']} #{record['seq']} on {record['group']}{shape} {record['state']}"
            f" (issued at step {record['step']} in {record['doing']})")


def compare(collectives: dict[int, Optional[dict[str, Any]]]) -> str:
    """What the ranks' last collectives say: ranks waiting in different calls (they took different code paths),
    ranks waiting while others are in none (those are behind), or every rank in one call (a peer slow in it)."""
    waiting = {rank: record for rank, record in collectives.items() if record and record["state"] == "waiting"}
    elsewhere = sorted(rank for rank in collectives if rank not in waiting)
    calls = {(record["op"], record["group"], record["seq"]) for record in waiting.values()}
    if len(calls) > 1:
        listed = "; ".join(f"rank {rank}: {describe(record)}" for rank, record in collectives.items())
        return (f" The ranks' last collectives differ ({listed}): they issued different collectives, or the same"
                " ones in a different order (a rank-dependent branch, a log(sync_dist=True) on some ranks only).")
    if waiting and elsewhere:
        return (f" Ranks {sorted(waiting)} wait in {describe(next(iter(waiting.values())))}; ranks {elsewhere} are"
                " in no collective (their last one completed): they are behind, in user code, or in a collective"
                " the recorder does not see.")
    if waiting:
        return " Every rank waits in the same call: a peer is slow or stuck inside it."
    return ""


def _shape(args: tuple) -> str:
    """The shape of the first tensor among a call's arguments (lists of tensors included), and how many."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return str(tuple(value.shape))
        if isinstance(value, (list, tuple)) and value:
            first = value[0]
            if isinstance(first, (list, tuple)) and first:
                first = first[0]
            if isinstance(first, torch.Tensor):
                return str(tuple(first.shape)) + (f" x{len(value)}" if len(value) > 1 else "")
    return ""


RECORDER = CollectiveRecorder()

_MARK = "_lightning_4d_recorded"
# ProcessGroup methods by the name of the torch.distributed call that users know them by.
_CALLED = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "allgather": "all_gather",
           "allgather_coalesced": "all_gather_coalesced", "_allgather_base": "all_gather_into_tensor",
           "all_gather_single": "all_gather_into_tensor", "allgather_into_tensor_coalesced":
           "all_gather_into_tensor_coalesced", "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
           "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
           "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced", "alltoall": "all_to_all",
           "alltoall_base": "all_to_all_single", "_end_coalescing": "end_coalescing"}
_P2P = {"send": 1, "recv": 1}  # the position of the peer among the arguments (after the tensors)


def _recorded_method(method: str, original: Any) -> Any:
    peer_at, name = _P2P.get(method), _CALLED.get(method, method)

    def call(group: Any, *args: Any, **kwargs: Any) -> Any:
        peer = args[peer_at] if peer_at is not None and len(args) > peer_at else None
        record = RECORDER.add(name, group, args, peer)
        work = original(group, *args, **kwargs)
        if work is not None:
            RECORDER.started(work, record)
        else:
            record[_STATE] = "done"
        return work

    setattr(call, _MARK, original)
    return call


def _recorded_wait(original: Any) -> Any:
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(work, *args, **kwargs)
        RECORDER.finished(work)
        return result

    setattr(wait, _MARK, original)
    return wait


def _recorded_functional(name: str, original: Any) -> Any:
    position = list(inspect.signature(original).parameters).index("group")

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into a graph: not a call issued now (and no graph break)
            return original(*args, **kwargs)
        group = kwargs.get("group", args[position] if len(args) > position else None)
        record = RECORDER.add(f"functional {name}", _functional_group(group), args)
        record[_STATE] = "async"
        return original(*args, **kwargs)

    setattr(call, _MARK, original)
    return call


def _functional_group(group: Any) -> Any:
    """The process group behind a functional collective's ``group`` argument (a mesh and dim, a 1-D mesh, a
    process group), or the argument itself when it names none."""
    try:
        if isinstance(group, tuple) and len(group) == 2:
            mesh, dim = group
            return mesh.get_group(dim)
        if hasattr(group, "get_group") and getattr(group, "ndim", 2) == 1:
            return group.get_group()
    except (RuntimeError, ValueError, IndexError, KeyError):
        pass
    return group if isinstance(group, (dist.ProcessGroup, str)) else repr(group)


def install() -> None:
    """Record every process-group call of this process from now on (idempotent; stays installed: the wrappers
    only append to the ring). Put back on top when something replaced a wrapper since (telemetry restores the
    methods it found, which are ours when it came after)."""
    for name in compat.PROCESS_GROUP_METHODS:
        current = vars(dist.ProcessGroup).get(name)
        if current is not None and not hasattr(current, _MARK):
            setattr(dist.ProcessGroup, name, _recorded_method(name, current))
    if not hasattr(vars(dist.Work)["wait"], _MARK):
        dist.Work.wait = _recorded_wait(vars(dist.Work)["wait"])
    module = compat.functional_collectives()
    for name in compat.FUNCTIONAL_COLLECTIVES:
        current = getattr(module, name, None)
        if current is not None and not hasattr(current, _MARK):
            setattr(module, name, _recorded_functional(name, current))


def uninstall() -> None:
    """Take the wrappers off again (benchmarks compare with and without)."""
    for name in compat.PROCESS_GROUP_METHODS:
        current = vars(dist.ProcessGroup).get(name)
        if current is not None and hasattr(current, _MARK):
            setattr(dist.ProcessGroup, name, getattr(current, _MARK))
    if hasattr(vars(dist.Work)["wait"], _MARK):
        dist.Work.wait = getattr(vars(dist.Work)["wait"], _MARK)
    module = compat.functional_collectives()
    for name in compat.FUNCTIONAL_COLLECTIVES:
        current = getattr(module, name, None)
        if current is not None and hasattr(current, _MARK):
            setattr(module, name, getattr(current, _MARK))
