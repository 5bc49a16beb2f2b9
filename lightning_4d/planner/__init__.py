"""The layout planner: what a model's sizes are (:mod:`.model_sizes`, read from sizes or a meta-device
module), what a layout costs in memory and communication (:mod:`.estimate`), how long its step takes (:mod:`.step_time`,
:mod:`.calibration`), the layouts ranked (:mod:`.ranking`; expert parallelism's share and
traffic: :mod:`.experts`), and ``python -m
lightning_4d.plan`` (:mod:`.cli`). Arithmetic only: importing it imports no torch."""

from lightning_4d.planner.estimate import (AC_MODES, BUILDS, CP_COMMS, OPTIMIZER_STATES, PP_SCHEDULES, PRECISIONS,
                                           Estimate, Layout, Training, activation_bytes_per_layer, all_layouts,
                                           choose_cp_comm, cp_exchanges, estimate, kept_bytes_per_layer,
                                           layout_problems)
from lightning_4d.planner.experts import MoESizes, expert_estimate
from lightning_4d.planner.model_sizes import Model, PlanError
from lightning_4d.planner.ranking import plan

__all__ = ["AC_MODES", "BUILDS", "CP_COMMS", "OPTIMIZER_STATES", "PP_SCHEDULES", "PRECISIONS", "Estimate", "Layout",
           "Model", "MoESizes", "PlanError", "Training", "activation_bytes_per_layer", "all_layouts", "choose_cp_comm",
           "cp_exchanges", "estimate", "expert_estimate", "kept_bytes_per_layer", "layout_problems", "plan"]
