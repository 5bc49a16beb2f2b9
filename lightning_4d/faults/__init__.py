"""Faults end a run loudly and quickly: a failing rank is named on every rank (:mod:`.report`), lost and
stalled ranks are found by heartbeats (:mod:`.liveness`), preemption signals end training at a step
boundary with a complete checkpoint (:mod:`.preemption`)."""

from lightning_4d.faults.report import report_failure

__all__ = ["report_failure"]
