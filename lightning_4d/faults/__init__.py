"""Faults end a run loudly and quickly: a failing rank is named on every rank (:mod:`.report`), lost and
stalled ranks are found by heartbeats (:mod:`.liveness`), preemption signals end training at a step
boundary with a complete checkpoint (:mod:`.preemption`), every rank's collectives are recorded for the failure
table (:mod:`.recorder`) and a collective waits at most a start-up or a training timeout (:mod:`.timeouts`)."""

from lightning_4d.faults.callback import (BatchShapeMismatchError, FaultTolerance, UnevenDataError, attach,
                                         broadcast_buffers)
from lightning_4d.faults.liveness import EXIT_RANK_LOST, EXIT_STALLED, Heartbeat
from lightning_4d.faults.preemption import EXIT_PREEMPTED, Preempted
from lightning_4d.faults.report import report_failure

__all__ = ["EXIT_PREEMPTED", "EXIT_RANK_LOST", "EXIT_STALLED", "BatchShapeMismatchError", "FaultTolerance",
           "Heartbeat", "Preempted", "UnevenDataError", "attach", "broadcast_buffers", "report_failure"]
