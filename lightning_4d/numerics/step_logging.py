"""What the user logs inside a step, made equal to the single-process value before Lightning sees it.

Under context parallelism each rank computes the loss of its part of the sequence; under pipeline
parallelism the user's step runs once per micro-batch and only the last stage has the real values. The
strategy records ``LightningModule.log`` calls while the step runs (``log_dict`` goes through ``log``),
combines them over micro-batches and over the ranks that split one sample (with the call's ``reduce_fx``:
a mean of equal-sized parts is the mean of the whole), and then makes the real ``log`` calls with identical
names on every rank. Identical names matter: ``sync_dist``, ModelCheckpoint(monitor=...) and EarlyStopping
run collectives keyed on them, and rank 0, the one that writes to loggers, may be a rank that computed none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_4d import _compat as compat
from lightning_4d.numerics.token_losses import TOKENS_ATTRIBUTE

_REDUCE_OPS = {"mean": "sum", "sum": "sum", "max": "max", "min": "min"}


def _reduce_name(kwargs: dict[str, Any]) -> str:
    fx = kwargs.get("reduce_fx", "mean")
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "")
    if name not in _REDUCE_OPS:
        raise ValueError(
            f"self.log(..., reduce_fx={fx!r}) cannot be combined across context-parallel ranks or pipeline"
            " micro-batches: use 'mean', 'sum', 'max' or 'min', or log a torchmetrics Metric."
        )
    return name


class StepLogs:
    """Records ``module.log`` calls, one record per micro-batch, and replays their combination."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self.records: list[dict[str, tuple[Any, dict[str, Any]]]] = []
        # per record, the token count a logged token-mean loss averages over: micro-batches are weighted by it
        self.weights: list[dict[str, Tensor]] = []

    @contextmanager
    def recording(self, index: Optional[int] = None) -> Iterator[None]:
        """Capture the logs of one micro-batch; ``index`` overwrites an earlier record (a re-run)."""
        record: dict[str, tuple[Any, dict[str, Any]]] = {}
        weights: dict[str, Tensor] = {}

        def log(name: str, value: Any, **kwargs: Any) -> None:
            if isinstance(value, Tensor):
                if getattr(value, TOKENS_ATTRIBUTE, None) is not None:
                    weights[name] = getattr(value, TOKENS_ATTRIBUTE)
                value = value.detach()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(float(value), device=self.module.device)  # NCCL reduces device tensors
            record[name] = (value, kwargs)

        enclosing = vars(self.module).get("log")  # another recorder (pipeline micro-batches around cp)
        self.module.log = log  # shadows the bound method for the duration of the step
        try:
            yield
        finally:
            if enclosing is None:
                del self.module.log
            else:
                self.module.log = enclosing
            if index is not None and index < len(self.records):
                self.records[index], self.weights[index] = record, weights
            else:
                self.records.append(record)
                self.weights.append(weights)

    def combined(self) -> dict[str, tuple[Any, dict[str, Any]]]:
        """Micro-batch records merged per name with each call's ``reduce_fx``; Metric objects pass through."""
        merged: dict[str, tuple[Any, dict[str, Any]]] = {}
        for name in dict.fromkeys(key for record in self.records for key in record):
            entries = [record[name] for record in self.records if name in record]
            weights = [w[name] for w in self.weights if name in w]
            value, kwargs = entries[-1]
            if isinstance(value, Tensor):
                stacked = torch.stack([v.float() for v, _ in entries])
                fx = _reduce_name(kwargs)
                if fx == "mean" and len(weights) == len(entries) > 1:  # token means: ΣS / ΣN, as one process
                    counts = torch.stack(weights).to(stacked.device, stacked.dtype)
                    value = (stacked * counts.view(-1, *[1] * (stacked.dim() - 1))).sum(0) / counts.sum()
                else:
                    value = {"mean": stacked.mean, "sum": stacked.sum, "max": stacked.amax,
                             "min": stacked.amin}[fx](0)
            merged[name] = (value, kwargs)
        self.records, self.weights = [], []
        return merged

    @staticmethod
    def all_reduce(values: dict[str, tuple[Any, dict[str, Any]]], group: dist.ProcessGroup,
                   reductions: Optional[Mapping[str, str]] = None) -> None:
        """Combine tensor values across ``group`` in place, each with its own ``reduce_fx``, or with the reduction
        ``reductions`` names for it instead (``"one"``: the same on every rank already, left as it is)."""
        size = dist.get_world_size(group)
        reductions = reductions or {}
        # One all-reduce per reduce op (and dtype and device), not one per logged value: every rank logs the
        # same names, so every rank builds the same batches in the same order.
        batches: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
        for name, (value, kwargs) in values.items():
            fx = reductions.get(name) or _reduce_name(kwargs)
            if isinstance(value, Tensor) and fx != "one":
                batches.setdefault((_REDUCE_OPS[fx], value.dtype, value.device), []).append((name, fx))
        for (op, _, _), entries in batches.items():
            flat = torch.cat([values[name][0].reshape(-1) for name, _ in entries])
            flat = compat.all_reduce_in_stream(flat, op, group)  # waited for on the device where it is used
            for (name, fx), part in zip(entries, flat.split([values[name][0].numel() for name, _ in entries])):
                value, kwargs = values[name]
                part = part.view_as(value)
                values[name] = (part / size if fx == "mean" else part, kwargs)

    def replay(self, values: dict[str, tuple[Any, dict[str, Any]]]) -> None:
        for name, (value, kwargs) in values.items():
            self.module.log(name, value, **kwargs)
