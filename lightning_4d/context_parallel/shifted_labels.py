"""Hugging Face ``labels=`` under context parallelism: targets shifted over the whole sequence, then sharded.

A Hugging Face causal LM shifts the ``labels`` it is given by one token inside its loss. On a zigzag shard that
pairs the last token of each of the rank's chunks with the first of its next chunk (or with nothing), not with the
next token of the sequence, which another rank holds. Every cp rank holds the whole batch before it is sharded, so
the shifted targets are formed there: the batch's labels shifted over the whole sequence and sharded like the
tokens, handed to the model as ``shift_labels=``, which its loss takes instead of shifting.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_4d import _compat as compat
from lightning_4d.context_parallel.positions import _forward_parameters

IGNORE_INDEX = -100  # Hugging Face's: the target after the last token


def shifts_labels(module: nn.Module) -> bool:
    """A Hugging Face model that shifts its ``labels`` input by one token itself: its forward takes ``labels`` and
    extra keywords and hands them to ``self.loss_function``, whose loss (``ForCausalLMLoss``: what HF resolves for
    causal LMs, also when ``loss_type`` is unset, as GPT-2's is) takes ``shift_labels`` instead."""
    if "labels" not in _forward_parameters(module) or not hasattr(type(module), "loss_function"):
        return False
    forward = inspect.signature(module.forward).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in forward) or ".loss_function(" not in _forward_source(type(module)):
        return False
    return "shift_labels" in inspect.signature(compat.hf_loss_function(module)).parameters


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _rows_of(tensor: Tensor, shard: Tensor) -> Optional[slice]:
    """Which rows of ``shard`` ``tensor`` is: all of it, or a view of consecutive rows (a micro-batch); None when
    it is neither (another tensor)."""
    if tensor is shard:
        return slice(None)
    if (tensor.dim() != shard.dim() or tensor.shape[1:] != shard.shape[1:] or tensor.stride() != shard.stride()
            or tensor.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()):
        return None
    offset, step = tensor.storage_offset() - shard.storage_offset(), max(shard.stride(0), 1)
    if offset % step:
        return None
    return slice(offset // step, offset // step + tensor.size(0))


def shifted_labels(labels: Tensor, shards: list[tuple[Tensor, Tensor]], dim: int,
                   positions: Tensor) -> Optional[Tensor]:
    """``labels`` (one of the sharded batch tensors ``shards`` pairs with its whole one, or consecutive rows of
    one) shifted by one token over the whole sequence, as this rank's shard (the global ``positions`` it holds);
    None when it is none of them."""
    for shard, whole in shards:
        rows = _rows_of(labels, shard)
        if rows is None:
            continue
        length = whole.size(dim)
        after = whole.narrow(dim, 1, length - 1)
        last = after.new_full((*after.shape[:dim], 1, *after.shape[dim + 1:]), IGNORE_INDEX)
        shifted = torch.cat([after, last], dim)
        return shifted[rows].index_select(dim, positions.to(labels.device))
    return None
