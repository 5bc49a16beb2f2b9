"""Preemption signals only set a flag; the ranks act on it together at the next step boundary.

A signal handler runs between two bytecodes of the main thread, possibly inside a checkpoint save or in the
middle of a collective sequence, so it must not issue a collective itself (Lightning's SIGTERM handler
broadcasts there, and dead-locks with DCP's collectives when every rank gets SIGTERM during a save). Here the
handler records the signal and returns; :class:`~lightning_4d.faults.callback.FaultTolerance` reads the flag
at the end of each training step, agrees with the other ranks in the step's one small all-gather, and when
any rank was signalled they all save ``last.ckpt`` and leave with :data:`EXIT_PREEMPTED`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from typing import Any, Optional, Union

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again (resume from last.ckpt)


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved; the process exits with its code."""


def parse_signals(signals: Union[tuple, list]) -> tuple[signal.Signals, ...]:
    """Signal names or numbers as ``signal.Signals``; one that is not a signal, or cannot be caught, fails."""
    if isinstance(signals, (str, int)):
        signals = (signals,)
    parsed = []
    for value in signals:
        try:
            parsed.append(signal.Signals[value] if isinstance(value, str) else signal.Signals(value))
        except (KeyError, ValueError):
            raise ValueError(f"signals: {value!r} is not a signal (use names such as 'SIGTERM', 'SIGUSR1')")
        if parsed[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"signals: {parsed[-1].name} cannot be caught.")
    return tuple(parsed)


_installed: "weakref.WeakSet[SignalFlag]" = weakref.WeakSet()


def release_signals() -> None:
    """Give back every installed handler (end of the failure report: until then a scheduler's or launcher's
    SIGTERM only waits, so that the report that names the cause gets printed)."""
    for flag in list(_installed):
        flag.uninstall()


class SignalFlag:
    """Our handler on each of ``signals`` while installed. Uninstalled, the previous handlers come back, and a
    signal that arrived but was never acted on (after the last step) is delivered again to them. If someone
    puts our handler back afterwards (Lightning restores the handlers it found when ``fit`` began), it passes
    signals straight on to the original handlers, so a signal after ``fit`` is never swallowed."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: list[signal.Signals] = []
        self.received_at: Optional[float] = None
        self._previous: dict[signal.Signals, Any] = {}
        self._original: dict[signal.Signals, Any] = {}
        self.active = False

    @property
    def requested(self) -> int:
        return int(self.received[0]) if self.received else 0

    def names(self) -> str:
        return ", ".join(sorted({s.name for s in self.received})) or "a signal"

    def _handle(self, signum: int, frame: Any) -> None:
        # Only records: no I/O, no collective (see the module doc).
        if not self.active:
            original = self._original.get(signal.Signals(signum), signal.SIG_DFL)
            if callable(original):
                original(signum, frame)
                return
            signal.signal(signum, original if original is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received.append(signal.Signals(signum))
        self.received_at = self.received_at or time.time()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.active = True
        _installed.add(self)
        for signum in self.signals:
            current = signal.getsignal(signum)
            if current == self._handle:
                continue
            # The first handler we replace is what we give back (Lightning's own, installed on top of it, goes).
            self._previous.setdefault(signum, current)
            self._original.setdefault(signum, current)
            signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        self.active = False
        _installed.discard(self)
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        pending, self.received = self.received, []
        for signum in dict.fromkeys(pending):
            os.kill(os.getpid(), signum)
