"""One rank fails, every rank stops, and every rank's output names the rank that failed first and why.

When a rank raises (user code, data loading, out of memory), it exits, its peers' next collective fails
with a bare connection error (gloo) or times out (``timeout`` of the strategy, NCCL). Before leaving, each
failing rank claims the first-failure slot in the rendezvous store; the winner is the rank whose own code
raised, since its peers only fail once it has gone. A rank that failed in a collective prints that first
failure, so the real traceback is what a user reads whichever rank's log they open.
"""

from __future__ import annotations

import sys
import time
import traceback

from lightning_4d._compat import default_store

_KEY = "lightning_4d/first_failure"


def report_failure(rank: int, exception: BaseException, world_size: int, linger: float = 15.0) -> None:
    """Record this rank's failure if it is the first; otherwise print the first one (best effort).

    Rank 0 hosts the store, so it waits (at most ``linger`` seconds) until every rank has reported before
    it exits and takes the store with it.
    """
    store = default_store()
    if store is None:
        return
    try:
        if store.add(_KEY + "/count", 1) == 1:
            text = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
            store.set(_KEY, f"rank {rank} failed first:\n{text}")
        elif store.check([_KEY]):
            first = store.get(_KEY).decode(errors="replace")
            print(f"[lightning-4d] rank {rank} stopped because {first}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + linger
        while rank == 0 and store.add(_KEY + "/count", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001  the store may be gone with the rank that hosted it
        return
