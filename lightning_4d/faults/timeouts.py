"""Two collective timeouts: a long one while a run starts (and while it saves or loads a checkpoint), a short
one once training steps run.

A collective that waits for a peer that never comes fails after its process group's timeout, on every rank
that waits: gloo raises ``Timed out waiting ...ms``, NCCL's watchdog aborts the process. Start-up legitimately
waits long (process-group set-up, the first step's allocations and compilation, a checkpoint load, ranks
started minutes apart by a scheduler), a training step does not: ``FourDStrategy(init_timeout=...)`` (default
:data:`DEFAULT_INIT_TIMEOUT`) applies until the first training step has ended and again around every
checkpoint save and load, ``FourDStrategy(timeout=...)`` (default :data:`DEFAULT_TIMEOUT`) from then on.
The heartbeats (:mod:`.liveness`) still end a job with a dead or stalled rank sooner; the timeout is what
ends ranks that all wait in collectives the others did not issue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from lightning_4d import _compat as compat

DEFAULT_INIT_TIMEOUT = timedelta(minutes=10)
DEFAULT_TIMEOUT = timedelta(minutes=2)


def check_timeout(name: str, value: object) -> timedelta:
    """A timeout argument as a positive ``timedelta`` (a number is seconds); anything else fails, naming it."""
    seconds = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (seconds and value > 0 or isinstance(value, timedelta) and value > timedelta(0)):
        raise ValueError(f"{name}={value!r} must be a positive timedelta (or seconds), e.g. {name}=timedelta(minutes=2)"
                         " or, in YAML, \"0:02:00\".")
    return timedelta(seconds=value) if seconds else value


class CollectiveTimeouts:
    """Which of the two timeouts every process group of this process has (see the module doc)."""

    def __init__(self, init: timedelta, train: timedelta) -> None:
        self.init, self.train = check_timeout("init_timeout", init), check_timeout("timeout", train)
        self.current = self.init

    def _set(self, timeout: timedelta, force: bool = False) -> None:
        if (timeout == self.current and not force) or not dist.is_initialized():
            self.current = timeout
            return
        for group in compat.process_groups():
            group.set_timeout(timeout)
        self.current = timeout

    def starting(self) -> None:
        """A fit (or validate, test, predict) sets up: the start-up timeout, on every group (the layout's groups
        were made with torch's default timeout, not the default group's)."""
        self._set(self.init, force=True)

    def training(self) -> None:
        """The first training step ended: the training timeout from now on."""
        self._set(self.train)

    @contextmanager
    def long(self) -> Iterator[None]:
        """The start-up timeout for a checkpoint save or load, then back to the timeout before it."""
        before = self.current
        self._set(max(self.init, before))
        try:
            yield
        finally:
            self._set(before)
