"""Tensor-parallel options, checked when ``FourDStrategy`` is constructed (and by the planner): a bad value
fails before processes start, with a message naming the argument, its value and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from lightning_4d.parallel_dims import ParallelDims


@dataclass(frozen=True)
class TensorParallelConfig:
    """The ``tp`` size and ``tp_*`` options of ``FourDStrategy``, validated on construction.

    ``plan``: ``"auto"``, ``"none"``/``None`` (off) or a mapping of module globs to styles, merged over the
    automatic plan (its entries are checked against the module by
    :func:`~lightning_4d.tensor_parallel.plan_tensor_parallel`); a ``configure_model`` that made DTensors is kept.
    ``sequence_parallel``: activations sharded on the sequence between the sharded regions. ``self_check``: the
    first batch runs one sharded block per type against a whole copy. ``strict``: raise, not warn, when under 90%
    of the body is sharded. ``loss_parallel``: cross entropy on vocabulary-sharded logits.
    """

    tp: int = 1
    plan: Union[str, Mapping[str, Any], None] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = True
    self_check: bool = True
    strict: bool = False  # under-sharding (below MIN_SHARDED of the body) raises instead of warning

    def __post_init__(self) -> None:
        ParallelDims.check_sizes(1, 1, 1, self.tp)
        plan = self.plan
        if not (plan is None or plan in ("auto", "none") or isinstance(plan, Mapping)):
            raise ValueError(f"tp_plan={plan!r}: use 'auto', 'none' or a mapping of module globs to styles, e.g."
                             " {'model.layers.*.mlp.up_proj': 'colwise', 'model.layers.*.mlp.down_proj': 'rowwise'}.")
        for name in ("sequence_parallel", "loss_parallel", "self_check", "strict"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                option = {"self_check": "tp_self_check", "strict": "tp_strict"}.get(name, name)
                raise ValueError(f"{option}={value!r} must be true or false.")

    @property
    def enabled(self) -> bool:
        """Whether the module will be sharded at all (``tp > 1`` and a plan that is not off)."""
        return self.tp > 1 and self.plan not in (None, "none")

    @property
    def sequence_shards(self) -> int:
        """How many parts sequence parallelism splits each context-parallel shard of a sequence into."""
        return self.tp if self.sequence_parallel and self.enabled else 1

    def check_with_pipeline(self, pp: int) -> None:
        """The cross-dimension rule: sequence parallelism cannot cross a pipeline stage boundary (``pp``: the
        pipeline size)."""
        if self.sequence_parallel and pp > 1:
            raise ValueError(f"sequence_parallel=True with pp={pp} is not supported: sequence parallelism keeps the"
                             " hidden state split over the tp ranks as a DTensor, and a pipeline stage sends a plain"
                             " tensor. Use sequence_parallel=False with pipeline parallelism.")

    def plan_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~lightning_4d.tensor_parallel.plan_tensor_parallel` after ``tp_size``."""
        return dict(tp_plan=self.plan, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)
