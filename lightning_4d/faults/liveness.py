"""Heartbeats in the rendezvous store: a rank that dies, is killed or stalls ends every rank, named.

Each rank runs one daemon thread that every ``interval`` seconds writes a small record to the store
(``lightning_4d/heartbeat/<rank>`` under this run's name, :func:`lightning_4d.parallel_dims.run_scoped_store`: a beat counter, how far the
main thread got, what it was last doing)
and reads every peer's record back in one ``multi_get``. Judged on each rank from the same records:

* **lost**: a peer's beat counter has not changed for ``lost_after`` seconds (its process is gone: killed,
  out of memory, crashed in C code), or the store itself is unreachable that long (rank 0, which hosts it,
  is gone). Every rank that sees it exits with :data:`EXIT_RANK_LOST`.
* **blocked by a failure**: a peer left after its own code raised, and this rank's main thread has not moved
  for ``3 * interval`` since: it waits in a collective with ranks that are also left waiting (gloo fails only
  the ranks connected to the one that left). It prints the first failure, as its own report would, and exits
  with :data:`EXIT_RANK_LOST`, instead of waiting until rank 0 gives up and takes the store with it.
* **stalled**: the peers still beat, but for ``stall_after`` seconds no rank's progress changed and some ranks
  are behind others (the ranks ahead wait in a collective for the ones behind, which are stuck in user code:
  a ``time.sleep``, a dead lock, a data loader that never returns). The ranks behind are named; they exit with
  :data:`EXIT_STALLED` after printing their own stack, the others with :data:`EXIT_RANK_LOST`. When every rank
  is at the same point nothing is judged (a long checkpoint save, a hang inside one collective: the
  collective ``timeout`` ends those).

Progress is a counter the main thread bumps with :meth:`Heartbeat.mark` (the fault callback does at each
Lightning hook of a step), so it costs an integer increment on the training thread; the store traffic is
one ``set`` and one ``multi_get`` per rank per interval, off the training thread.

The thread ends the process with ``os._exit``: the main thread may be blocked in a collective that will
never return, so no Python-level exception could reach it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist

from lightning_4d.parallel_dims import run_scoped_store
from lightning_4d.faults.recorder import RECORDER, compare, describe

EXIT_RANK_LOST = 76  # another rank died, was killed or stalled
EXIT_STALLED = 77  # this rank stalled (the others waited for it)

DEFAULT_INTERVAL = 1.0
DEFAULT_LOST_AFTER = 10.0
DEFAULT_STALL_AFTER = 120.0

_PREFIX = "lightning_4d/heartbeat/"
FIRST_FAILURE_KEY = "lightning_4d/first_failure"  # the first failure's text, claimed by ``report`` (see there)


_current: Optional["Heartbeat"] = None


def current() -> Optional["Heartbeat"]:
    """This process's running heartbeat, if any (the failure report reads who is still alive from it)."""
    return _current


def _key(rank: int) -> str:
    return f"{_PREFIX}{rank}"


def read_first_failure(store: dist.Store, wait: float = 10.0) -> str:
    """The first failure's text. The rank that claimed the slot (the first to count itself) writes it just after
    (formatting its traceback takes a moment, longer on a loaded machine): a rank that comes second waits."""
    deadline = time.monotonic() + wait
    while not store.check([FIRST_FAILURE_KEY]):
        if time.monotonic() > deadline:
            return f"another rank failed first; it did not write its failure within {wait:.0f} s\n"
        time.sleep(0.02)
    return store.get(FIRST_FAILURE_KEY).decode(errors="replace")


def check_options(interval: float, lost_after: float, stall_after: Optional[float]) -> None:
    """Bad settings fail when the callback is made, before any process group exists."""
    for name, value in (("heartbeat_interval", interval), ("lost_after", lost_after)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds.")
    if lost_after < 2 * interval:
        raise ValueError(f"lost_after={lost_after} must be at least twice heartbeat_interval={interval}: a rank is"
                         " only judged lost after it missed more than one beat.")
    if stall_after is not None and (isinstance(stall_after, bool) or not isinstance(stall_after, (int, float))
                                    or stall_after < lost_after):
        raise ValueError(f"stall_after={stall_after!r} must be None (off) or a number of seconds of at least"
                         f" lost_after={lost_after}.")


class Heartbeat:
    """One rank's heartbeat thread (see the module doc). ``exit`` ends the process (``os._exit`` by default;
    a test may pass a recorder)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = DEFAULT_INTERVAL,
                 lost_after: float = DEFAULT_LOST_AFTER, stall_after: Optional[float] = DEFAULT_STALL_AFTER,
                 exit: Callable[[int], Any] = os._exit) -> None:
        check_options(interval, lost_after, stall_after)
        # A connection of its own (``clone``): torch's store client answers one request at a time, and the main
        # thread may wait in it for long (a pipeline stage reading the last stage's results, gloo's group set-up):
        # beats sent through it waited behind that, and peers called this rank lost. Under this run's name: a
        # restarted job's store still holds the records of the attempt before (parallel_dims.run_scoped_store).
        self.store = run_scoped_store(store.clone() if store is not None else None)
        self._given_store = store  # a clone is a client only: the store's server lives as long as the original
        self.rank, self.world_size = rank, world_size
        self.interval, self.lost_after, self.stall_after = float(interval), float(lost_after), stall_after
        self._exit = exit
        self.progress = 0
        self.doing = "starting"
        self.step = -1
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[int, tuple[Any, float]] = {}  # peer -> (beat, local time it last changed)
        self._peers: dict[int, dict[str, Any]] = {}  # peer -> its last record
        self._job_progress: tuple[Any, float] = (None, time.monotonic())
        self._store_failing_since: Optional[float] = None
        self._still_since: Optional[tuple[int, float]] = None  # (progress, since) once a peer left failing
        self._reporter: Optional[str] = None  # who reports this rank's end: "main" (its own failure) or "thread"
        self._reporter_lock = threading.Lock()

    # ------------------------------------------------------------------------------- main thread

    def mark(self, doing: str, step: int) -> None:
        """The main thread reached ``doing`` (``"training_step"``, ``"backward"``, ...) of ``step``."""
        self.progress += 1
        self.doing, self.step = doing, step

    def start(self) -> "Heartbeat":
        global _current
        _current = self
        self._publish()  # peers see this rank from the first moment
        self._thread = threading.Thread(target=self._run, name="lightning-4d-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, finished: str = "finished") -> None:
        """End the thread and tell the peers this rank left on purpose (they will not call it lost)."""
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self._publish_left(finished)
        except Exception:  # noqa: BLE001  the store may be gone with rank 0
            pass

    def claim_report(self, who: str) -> bool:
        """Exactly one of the main thread (its own failure's report) and this thread (the "blocked" judgement)
        reports this rank's end: both counting it would let rank 0 think every rank reported and take the store
        away from one that has not."""
        with self._reporter_lock:
            if self._reporter is None:
                self._reporter = who
            return self._reporter == who

    def alive_peers(self, within: float) -> set[int]:
        """Ranks whose beat changed within the last ``within`` seconds, and which have not left. Read from the
        store now once this rank's thread has stopped (rank 0 waiting for the others' reports after its own):
        its last view would make every peer look silent after ``within`` seconds."""
        if self._stop.is_set():
            self._note(self._read_peers(), time.monotonic())
        now = time.monotonic()
        return {rank for rank, (_, since) in self._seen.items()
                if now - since <= within and "left" not in self._peers.get(rank, {})}

    def _peers_beating(self) -> bool:
        try:
            return bool(self.alive_peers(within=2 * self.interval))
        except Exception:  # noqa: BLE001  nothing to wait for if the store cannot be read
            return False

    def find_lost(self, wait: Optional[float] = None) -> list[int]:
        """Peers whose beat does not change within ``wait`` seconds (default: two intervals and a half) and who
        did not leave on purpose, read from the store now (on the failure path: a collective just failed).
        When the store itself is gone, rank 0 (its host) is the lost one."""
        wait = 2.5 * self.interval if wait is None else wait
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        try:
            first = dict(zip(peers, self.store.multi_get([_key(rank) for rank in peers])))
            self._peers.update({rank: json.loads(value) for rank, value in first.items()})  # for the table
            deadline = time.monotonic() + wait
            silent = set(peers)
            while silent and time.monotonic() < deadline:
                time.sleep(min(0.1, self.interval / 4))
                now = dict(zip(peers, self.store.multi_get([_key(rank) for rank in peers])))
                silent = {rank for rank in silent if now[rank] == first[rank] and b"left" not in now[rank]}
        except Exception:  # noqa: BLE001  the store is gone: its host is
            return [0] if self.rank != 0 else []
        return sorted(silent)

    def table(self) -> str:
        """What every rank was last doing, as this rank last read it: step, hook, and the last collective it
        issued (:mod:`.recorder`), with its sequence number on its group; ranks whose last collectives differ
        issued different collectives (a flight recorder of the job)."""
        now = time.monotonic()
        lines = [f"{'rank':>6}  {'step':>6}  {'progress':>8}  {'last beat':>9}  {'doing':<24}  last collective"]
        for rank in range(self.world_size):
            record = self._peers.get(rank) if rank != self.rank else self._record()
            if record is None:
                lines.append(f"{rank:>6}  {'?':>6}  {'?':>8}  {'never':>9}  (no heartbeat seen)")
                continue
            collective = describe((record.get("coll") or [None])[-1])
            if "left" in record:
                doing = f"left: {record['left']}"
                lines.append(f"{rank:>6}  {record.get('step', ''):>6}  {'':>8}  {'':>9}  {doing:<24}  {collective}")
                continue
            age = 0.0 if rank == self.rank else now - self._seen.get(rank, (None, now))[1]
            lines.append(f"{rank:>6}  {record['step']:>6}  {record['progress']:>8}  {age:>8.1f}s  {record['doing']:<24}"
                         f"  {collective}")
        return "\n".join(lines)

    def collectives(self) -> dict[int, Optional[dict[str, Any]]]:
        """Every rank's last collective record, as this rank last read them (None: none seen)."""
        known = {rank: (record.get("coll") or [None])[-1] for rank, record in self._peers.items()}
        known[self.rank] = (RECORDER.last() or [None])[-1]
        return {rank: known.get(rank) for rank in range(self.world_size)}

    # ---------------------------------------------------------------------------- the thread

    def _record(self) -> dict[str, Any]:
        return {"beat": self._beat, "progress": self.progress, "doing": self.doing, "step": self.step,
                "coll": RECORDER.last()}

    def _publish(self) -> None:
        self._beat += 1
        self.store.set(_key(self.rank), json.dumps(self._record()))

    def _publish_left(self, why: str) -> None:
        """This rank's record once it leaves on purpose (``why``): peers do not call it lost, and its last
        collective stays readable (a peer's failure table shows it)."""
        self.store.set(_key(self.rank), json.dumps({"left": why, "step": self.step, "doing": self.doing,
                                                    "coll": RECORDER.last()}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                records = self._read_peers()
                self._store_failing_since = None
            except Exception as error:  # noqa: BLE001  the store host (rank 0) may be gone
                if self._stop.is_set():
                    return
                now = time.monotonic()
                self._store_failing_since = self._store_failing_since or now
                if now - self._store_failing_since >= self.lost_after:
                    self._fail(EXIT_RANK_LOST, f"rank 0 (it hosts the rendezvous store) is lost: the store has"
                                               f" been unreachable for {now - self._store_failing_since:.1f} s"
                                               f" ({type(error).__name__}: {error})")
                continue
            if self._stop.is_set():
                return
            self._judge(records)

    def _read_peers(self) -> dict[int, dict[str, Any]]:
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        present = [rank for rank in peers if rank in self._peers or self.store.check([_key(rank)])]
        values = self.store.multi_get([_key(rank) for rank in present]) if present else []
        return {rank: json.loads(value) for rank, value in zip(present, values)}

    def _note(self, records: dict[int, dict[str, Any]], now: float) -> None:
        """Each peer's last record, and when its beat last changed."""
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            record = records.get(rank)
            if record is not None:
                self._peers[rank] = record
            beat = None if record is None else record.get("beat", "left")
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)

    def _judge(self, records: dict[int, dict[str, Any]]) -> None:
        now = time.monotonic()
        self._note(records, now)
        failed = sorted(rank for rank, record in self._peers.items() if str(record.get("left", "")).startswith("failed"))
        if failed and self._reporter != "main":
            self._judge_blocked(now, failed)
        if any("left" in record for record in self._peers.values()):
            return  # a rank finished or failed on purpose: its own report (or the end of the job) follows
        lost = sorted(rank for rank, (beat, since) in self._seen.items() if now - since >= self.lost_after)
        never = [rank for rank in range(self.world_size) if rank != self.rank and rank not in self._peers]
        if lost:
            names = ", ".join(f"rank {rank}" + (" (never started)" if rank in never else "") for rank in lost)
            self._fail(EXIT_RANK_LOST, f"{names} lost: no heartbeat for {self.lost_after:.0f} s (the process died"
                                       " or was killed, or its machine is unreachable)")
            return
        self._judge_stall(now)

    def _judge_blocked(self, now: float, failed: list[int]) -> None:
        """A peer failed: unless this rank's main thread moves (or fails itself) within three beats, it waits in
        a collective that will not finish; say whose failure stopped it, count as reported, and leave."""
        if self._still_since is None or self._still_since[0] != self.progress:
            self._still_since = (self.progress, now)
            return
        if now - self._still_since[1] < 3 * self.interval or not self.claim_report("thread"):
            return
        try:
            first = read_first_failure(self.store) if self.store.add(FIRST_FAILURE_KEY + "/count", 1) > 1 else (
                f"rank {failed[0]} failed first: its failure was not recorded\n")
            self.store.set(f"{FIRST_FAILURE_KEY}/reported/{self.rank}", "1")
            # Left after a failure, not lost: a peer whose collective breaks when this process ends says so.
            self._publish_left(f"failed (blocked by rank {failed[0]})")
        except Exception:  # noqa: BLE001  the store may be gone with rank 0: the store judgement follows
            return
        print(f"[lightning-4d] rank {self.rank} stopped because {first}[lightning-4d] rank {self.rank} was waiting"
              f" in {self.doing} of step {self.step} for ranks that will not come (exit {EXIT_RANK_LOST}).",
              file=sys.stderr, flush=True)
        self._fail(EXIT_RANK_LOST, f"rank {failed[0]} failed and left this rank waiting in a collective")

    def _judge_stall(self, now: float) -> None:
        if self.stall_after is None or len(self._peers) < self.world_size - 1:
            return
        progress = {rank: record["progress"] for rank, record in self._peers.items()}
        progress[self.rank] = self.progress
        snapshot = tuple(sorted(progress.items()))
        if snapshot != self._job_progress[0]:
            self._job_progress = (snapshot, now)
            return
        waited = now - self._job_progress[1]
        if waited < self.stall_after or len(set(progress.values())) == 1:
            return
        behind = sorted(rank for rank, value in progress.items() if value == min(progress.values()))
        doing = {rank: (self._record() if rank == self.rank else self._peers[rank]) for rank in behind}
        where = "; ".join(f"rank {rank} at step {doing[rank]['step']} in {doing[rank]['doing']}" for rank in behind)
        message = (f"{'rank' if len(behind) == 1 else 'ranks'} {', '.join(map(str, behind))} stalled: no progress"
                   f" for {waited:.0f} s ({where}) while the other ranks wait for {'it' if len(behind) == 1 else 'them'}"
                   " in a collective (a rank behind is stuck in user code, or in a collective the others never issued,"
                   " such as a log(sync_dist=True) on one rank only: its stack shows where)")
        if self.rank in behind:
            print(f"[lightning-4d] rank {self.rank}: this rank is stalled; where its threads are:", file=sys.stderr,
                  flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._fail(EXIT_STALLED, message, stalled=True)
            return
        self._fail(EXIT_RANK_LOST, message, stalled=True, behind_alive=True)

    def _fail(self, code: int, message: str, stalled: bool = False, behind_alive: bool = False) -> None:
        # A stall leaves every rank's last collective current: whether they differ says where it waits.
        compared = compare(self.collectives()) if stalled else ""
        print(f"[lightning-4d] rank {self.rank} stops (exit {code}): {message}.{compared} Last"
              f" known state of every rank (as seen by rank {self.rank}):\n{self.table()}", file=sys.stderr, flush=True)
        self._stop.set()
        # This judgement is the rank's report: a collective that breaks in the main thread as the peers leave after
        # it is its consequence, and must not end the process first with an exit of its own (report_failure).
        self.claim_report("thread")
        if self.rank == 0:
            # This process hosts the store: keep it up while the peers still beat, reading it to reach the same
            # judgement (a loaded machine can delay a peer's thread by seconds); a peer that judges nothing else
            # finds this rank's beat gone after ``lost_after`` and a beat, and is seen to stop two beats later.
            deadline = time.monotonic() + self.lost_after + 4 * self.interval
            while time.monotonic() < deadline and self._peers_beating():
                time.sleep(0.1)
        elif behind_alive:
            # The stalled rank reaches the same judgement within a heartbeat: leaving now would break the
            # collective it waits in before it has printed its stack (which shows the user's line).
            time.sleep(2 * self.interval)
        self._exit(code)
