"""What a run reports about itself: tokens/s, MFU, memory and communication per dimension
(:mod:`.telemetry`), and in debug mode the checks that ranks stay in step (:mod:`.desync`)."""

from lightning_4d.observability.telemetry import Telemetry

__all__ = ["Telemetry"]
