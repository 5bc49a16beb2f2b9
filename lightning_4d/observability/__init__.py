"""What a run reports about itself: tokens/s, MFU, memory and communication per dimension
(:mod:`.telemetry`), and in debug mode the checks that ranks stay in step (:mod:`.desync`)."""

from datetime import timedelta
from typing import Any, Optional

from lightning_4d.observability.desync import DesyncMonitor
from lightning_4d.observability.telemetry import Telemetry

__all__ = ["DesyncMonitor", "Telemetry", "attach"]


def attach(strategy: Any, callbacks: list, monitor: Optional[DesyncMonitor]) -> Optional[DesyncMonitor]:
    """What the strategy's ``debug`` and ``telemetry`` ask for, once its mesh exists: the desync monitor (kept
    across fits: returned, ``monitor`` if there is one already) and a :class:`Telemetry` callback unless the
    Trainer has one."""
    if strategy.telemetry and not any(isinstance(c, Telemetry) for c in callbacks):
        callbacks.append(Telemetry())
    if strategy.debug and monitor is None:
        return DesyncMonitor(strategy.mesh, strategy.debug_steps, timeout=min(strategy.timeout, timedelta(seconds=60)))
    return monitor
