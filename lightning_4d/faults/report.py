"""One rank fails, every rank stops, and every rank's output names the rank that failed first and why.

When a rank raises (user code, data loading, out of memory), it exits, its peers' next collective fails
with a bare connection error (gloo) or times out (``timeout`` of the strategy, NCCL). Before leaving, each
failing rank claims the first-failure slot in the rendezvous store; the winner is the rank whose own code
raised, since its peers only fail once it has gone. A rank that failed in a collective prints that first
failure, so the real traceback is what a user reads whichever rank's log they open.

Rank 0 hosts the store, so it stays until the other ranks have reported, but only those that still beat
(:mod:`lightning_4d.faults.liveness`): a rank that is already gone is not waited for. Each rank also prints
the heartbeat table: what every rank was last doing (step, hook and last collective, from
:mod:`lightning_4d.faults.recorder`), as it last saw them. When a collective failed or timed out and no rank
is lost, the report says whether the ranks were in the same collective or in different ones, and each rank
prints its own last few collectives.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
import traceback
from typing import Optional

import torch.distributed as dist

from lightning_4d._compat import default_store
from lightning_4d.faults import liveness
from lightning_4d.faults.recorder import RECORDER, compare, describe
from lightning_4d.faults.preemption import Preempted, release_signals
from lightning_4d.parallel_dims import run_scoped_store

_KEY = liveness.FIRST_FAILURE_KEY


class RaisedOnEveryRank(RuntimeError):
    """An error every rank raises together from the same gathered facts (so no rank failed "first")."""


_raised = False  # this process is leaving on an exception: its collectives may never finish
_exit_registered = False
_GIL_HANDOFF = 0.01  # seconds the main thread leaves the GIL to threads that wait for it, at exit


def destroy_process_groups_at_exit() -> None:
    """Once per process, when the strategy has made its process groups: end them at interpreter exit, while
    Python is still whole (:func:`_destroy_unless_raised`). Not after an exception: destroying waits for this
    rank's unfinished collectives, which a failure may have left with no peer to finish them."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_destroy_unless_raised)


def _destroy_unless_raised() -> None:
    """The end of a process that trained, in one order, while Python is whole: no thread of ours left; nothing
    of ours holding the process groups; the groups destroyed; gloo's worker threads done with Python.

    Why the last part: a gloo worker thread drops its references to a collective's tensors after the collective
    completes, and dropping a tensor that has a Python object takes the GIL (on torch 2.15 every time, on older
    torch when it holds the last reference). A thread that asks for the GIL once the interpreter has begun
    finalizing is ended with ``pthread_exit``, which unwinds through a ``noexcept`` destructor: std::terminate,
    "terminate called without an active exception", SIGABRT, after a run that succeeded (pytorch/pytorch#190489).
    A collective completed a few milliseconds before the process leaves (a last ``reduce``, a synced log) is
    enough. :func:`_release_collective_threads` closes that window."""
    if _raised:  # destroying would wait for collectives a failure may have left with no peer to finish them
        return
    heartbeat = liveness.current()
    if heartbeat is not None:  # a fit that ended without its teardown hook
        heartbeat.stop("finished")
    if dist.is_initialized():
        RECORDER.forget_groups()
        dist.destroy_process_group()
    _release_collective_threads()
    sys.stdout.flush()
    sys.stderr.flush()


def _release_collective_threads() -> None:
    """Let every gloo worker thread finish with Python before the interpreter finalizes.

    The destroyed groups are still held by the garbage of the run (Lightning's and the model's reference
    cycles): collecting it destroys them, and a group's destructor joins its worker threads with the GIL
    released, so each finishes what it was doing first. That collection is the first one finalization would
    make: turning automatic collection off for the rest of the exit skips that one (finalization's last, after
    the modules are cleared, still runs), so exiting costs no more time. A group something alive still holds (a
    trainer in a module's globals) keeps its threads; releasing the GIL for a moment lets one waiting for it
    take it."""
    gc.collect()
    gc.disable()
    time.sleep(_GIL_HANDOFF)


def report_failure(rank: int, exception: BaseException, world_size: int, linger: float = 15.0) -> None:
    """Record this rank's failure if it is the first; otherwise print the first one (best effort).

    Rank 0 hosts the store, so it waits (at most ``linger`` seconds) until every rank that is still alive has
    reported before it exits and takes the store with it; with heartbeats running, a rank whose heartbeat
    stopped is not waited for.
    """
    global _raised
    _raised = True
    store = run_scoped_store(default_store())  # this run's first-failure slot, not a restarted job's earlier one
    heartbeat = liveness.current()
    if isinstance(exception, (Preempted, RaisedOnEveryRank)):  # every rank leaves together, on purpose
        if heartbeat is not None:
            heartbeat.stop("preempted" if isinstance(exception, Preempted) else type(exception).__name__)
        release_signals()
        return
    if heartbeat is not None and not heartbeat.claim_report("main"):
        # Its heartbeat thread already judged this rank blocked by a peer's failure: it is printing that failure
        # and ends the process (exit EXIT_RANK_LOST); this failure is that one's consequence.
        time.sleep(heartbeat.lost_after + 5 * heartbeat.interval)
        return
    try:
        _report(store, heartbeat, rank, exception, world_size, linger)
    finally:
        release_signals()


def _report(store, heartbeat, rank: int, exception: BaseException, world_size: int, linger: float) -> None:
    if store is None:
        return
    try:
        # A collective that failed because a peer vanished: find that peer by its heartbeat before blaming this
        # rank (gloo's "Connection reset by peer" names neither).
        # Not when a rank has claimed the first failure already: the ranks that left after it are its consequence.
        lost = (heartbeat.find_lost() if heartbeat is not None and _is_communication_error(exception)
                and store.add(_KEY + "/count", 0) == 0 else [])
        if lost:
            names = ", ".join(f"rank {peer}" for peer in lost)
            text = (f"{names} {'was' if len(lost) == 1 else 'were'} lost (no heartbeat: the process died or was"
                    f" killed); rank {rank}'s collective failed with {type(exception).__name__}: {exception}")
            print(f"[lightning-4d] rank {rank} stopped because {text}", file=sys.stderr, flush=True)
            store.set(_KEY, f"{text}\n")
            store.add(_KEY + "/count", 1)
        elif store.add(_KEY + "/count", 1) == 1:
            text = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
            store.set(_KEY, f"rank {rank} failed first:\n{text}")
        else:  # the first rank claimed the slot and writes its traceback into it: wait for that
            first = liveness.read_first_failure(store)
            print(f"[lightning-4d] rank {rank} stopped because {first}", file=sys.stderr, flush=True)
        store.set(f"{_KEY}/reported/{rank}", "1")
        if _is_communication_error(exception) and not lost:
            mine = "\n".join(f"  {describe(record)}" for record in RECORDER.last(5)) or "  none"
            print(f"[lightning-4d] rank {rank}: a collective failed ({_first_line(exception)})."
                  f"{compare(heartbeat.collectives()) if heartbeat is not None else ''} This rank's last"
                  f" collectives, oldest first:\n{mine}", file=sys.stderr, flush=True)
        if heartbeat is not None:
            heartbeat.stop(f"failed ({type(exception).__name__})")
            print(f"[lightning-4d] rank {rank}: last known state of every rank:\n{heartbeat.table()}",
                  file=sys.stderr, flush=True)
        deadline = time.monotonic() + linger
        while rank == 0 and time.monotonic() < deadline and _waiting_for(store, world_size, heartbeat):
            time.sleep(0.1)
    except Exception as error:  # noqa: BLE001  the store may be gone with the rank that hosted it
        print(f"[lightning-4d] rank {rank} failed with {_first_line(exception)}; its report through the rendezvous"
              f" store did not complete ({_first_line(error)}): rank 0, which hosts the store, may be gone",
              file=sys.stderr, flush=True)


def _is_communication_error(exception: Optional[BaseException], depth: int = 0) -> bool:
    """Whether the exception, or one it was raised from, is a failed collective (torch.distributed.pipelining
    wraps a failed receive in ``RuntimeError("[Stage 1] failed to run forward ...")`` that names no peer)."""
    if exception is None or depth > 8:
        return False
    text = str(exception)
    if isinstance(exception, dist.DistError) or any(
            word in text for word in ("gloo", "Connection reset", "Connection closed", "NCCL", "Broken pipe")):
        return True
    return _is_communication_error(exception.__cause__ or exception.__context__, depth + 1)


def _first_line(exception: BaseException) -> str:
    lines = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {lines[0] if lines else ''}"


def _waiting_for(store, world_size: int, heartbeat) -> bool:
    """Whether rank 0 should keep the store up: some rank has not reported and may still (it is alive). Each
    rank's own key, not a count: a count could be reached while one rank has not read the failure yet."""
    if store.check([f"{_KEY}/reported/{rank}" for rank in range(world_size)]):
        return False
    if heartbeat is None:
        return True
    alive = heartbeat.alive_peers(within=3 * heartbeat.interval)
    return any(not store.check([f"{_KEY}/reported/{rank}"]) for rank in alive)
