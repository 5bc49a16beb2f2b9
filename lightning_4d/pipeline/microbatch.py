"""Splitting a batch of any structure into micro-batches, and merging per-micro-batch step outputs.

The strategy splits the batch itself (the schedule only sees micro-batch indices), so the user's step gets
the same structure it gets in one process: tensors, dicts, tuples, namedtuples, dataclasses. Every tensor
is cut along dim 0 into equal parts; equal parts are what makes the mean of the micro-batch losses the loss
of the whole batch. Anything that is not a tensor is passed whole to every micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def split_batch(batch: Any, n: int) -> list[Any]:
    """``n`` micro-batches of the batch's own structure; a ValueError if a tensor does not split evenly."""
    uneven: list[tuple[int, ...]] = []

    def check(tensor: Tensor) -> Tensor:
        if tensor.ndim and tensor.shape[0] % n:
            uneven.append(tuple(tensor.shape))
        return tensor

    apply_to_collection(batch, Tensor, check)
    if uneven:
        shapes = ", ".join(map(str, dict.fromkeys(uneven)))
        raise ValueError(
            f"The batch does not split into pp_microbatches={n} equal micro-batches: tensors of shape {shapes}"
            f" have a first dimension that is not a multiple of {n}. Use a batch size that is a multiple of {n}"
            " (with drop_last=True in the DataLoader, so that the last batch is full too), or set pp_microbatches"
            " to a divisor of the batch size.")
    pieces: dict[int, tuple[Tensor, ...]] = {}

    def piece(tensor: Tensor, index: int) -> Tensor:
        if tensor.ndim == 0:
            return tensor
        return pieces.setdefault(id(tensor), tensor.chunk(n))[index]

    return [apply_to_collection(batch, Tensor, piece, index) for index in range(n)]


def shape_key(batch: Any) -> tuple:
    """Shapes and dtypes of a micro-batch: equal keys give equal activation shapes at stage boundaries."""
    found: list[tuple] = []
    apply_to_collection(batch, Tensor, lambda t: found.append((tuple(t.shape), t.dtype)))
    return tuple(found)


def detached(value: Any) -> Any:
    """The step output without autograd history: it outlives the step, the graph must not."""
    return apply_to_collection(value, Tensor, Tensor.detach)


def merge(values: list[Any]) -> Any:
    """One step output from the micro-batches' outputs: scalars are averaged (a loss of the whole batch),
    other tensors concatenated along dim 0 (predictions), containers merged field by field."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.ndim == 0:
            stacked = torch.stack(values)
            return stacked.mean() if stacked.is_floating_point() else stacked
        return torch.cat(values)
    if isinstance(first, Mapping):
        return type(first)({key: merge([v[key] for v in values]) for key in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge(list(column)) for column in zip(*values)))
    if isinstance(first, (list, tuple)):
        return type(first)(merge(list(column)) for column in zip(*values))
    return list(values)
