"""torchmetrics metrics logged per step under context parallelism: the step value of the whole batch.

A metric's ``forward`` returns its value on the batch it is given, and Lightning logs that value per step; under
cp each rank is given its own tokens only. While a step runs sharded, each metric of the module computes its step
value from its batch states reduced over the cp group as torchmetrics reduces them over processes (sum, mean, max,
min), on the device's streams: the host never waits. What the metric accumulates for the epoch stays this rank's,
and torchmetrics combines it over every process at ``compute``, as before. A state torchmetrics concatenates (a
list, ``"cat"``) or reduces with a function of its own cannot be reduced that way: such a metric is refused,
naming it, with the fix (log it per epoch). Under pipeline parallelism the runner gives metrics their step value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from lightning_4d import _compat as compat


class WholeBatchMetrics:
    """The metrics of ``module``, whose per-step values :meth:`running` makes the whole batch's over ``group``."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        from torchmetrics import Metric

        self.group, self.size = group, dist.get_world_size(group)
        self.metrics = {fqn: m for fqn, m in module.named_modules() if isinstance(m, Metric)}
        self._batches: dict[str, Any] = {}

    @contextmanager
    def running(self) -> Iterator[None]:
        """While a step runs sharded: each metric's ``forward`` gives the whole batch's value."""
        for fqn, metric in self.metrics.items():
            metric.forward = self._forward(fqn, metric)
        try:
            yield
        finally:
            for metric in self.metrics.values():
                metric.__dict__.pop("forward", None)

    def _forward(self, fqn: str, metric: Any) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            batch = self._batches.get(fqn)
            if batch is None:
                batch = self._batches[fqn] = compat.MetricOnBatch(metric)
            batch.reset()
            batch.update(*args, **kwargs)
            for name, op in compat.metric_reductions(metric).items():
                state = getattr(batch.states, name)
                if op not in ("sum", "mean", "max", "min") or isinstance(state, list):
                    raise ValueError(
                        f"{fqn} ({type(metric).__name__}) is called for its value on each step under context"
                        f" parallelism, but its state {name!r} is reduced over processes by {op!r}, which this rank"
                        " cannot combine with the other cp ranks' during the step. Log it per epoch (self.log(...,"
                        " on_step=False, on_epoch=True): its epoch value is synchronized and exact), or use cp=1.")
                reduced = compat.all_reduce_in_stream(state, "sum" if op == "mean" else op, self.group)
                setattr(batch.states, name, reduced / self.size if op == "mean" else reduced)
            value = batch.compute()
            metric.update(*args, **kwargs)
            compat.set_metric_forward_cache(metric, value)
            return value

        return forward
