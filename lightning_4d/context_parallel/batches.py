"""Which tensors of a batch hold sequences (and so are sharded over cp), found by shape or named by the user."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Callable, Optional, Union

from torch import Tensor


def _map_tensors(value: Any, fn: Callable[[str, Tensor], Tensor], path: tuple[str, ...] = ()) -> Any:
    """``value`` with every tensor replaced by ``fn(dotted path, tensor)``; containers keep their types."""
    if isinstance(value, Tensor):
        return fn(".".join(path), value)
    if isinstance(value, MutableMapping):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = _map_tensors(item, fn, (*path, str(key)))
        return out
    if isinstance(value, Mapping):
        return type(value)({key: _map_tensors(item, fn, (*path, str(key))) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(item, fn, (*path, name)) for name, item in zip(value._fields, value)))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn, (*path, str(i))) for i, item in enumerate(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _map_tensors(getattr(value, f.name), fn, (*path, f.name))
                  for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    return value


def _tensors(batch: Any) -> dict[str, Tensor]:
    found: dict[str, Tensor] = {}

    def record(path: str, tensor: Tensor) -> Tensor:
        found[path] = tensor
        return tensor

    _map_tensors(batch, record)
    return found


def sequence_paths(batch: Any, seq_dim: int = 1,
                   keys: Optional[Sequence[Union[str, int]]] = None) -> tuple[list[str], int]:
    """Which tensors of ``batch`` to shard (dotted paths: ``"input_ids"``, ``"0"``) and the sequence length.

    By default the first tensor with a ``seq_dim`` defines the length and every tensor with that length on
    ``seq_dim`` is sharded; ``keys`` names them instead.
    """
    tensors = _tensors(batch)
    if keys is None:
        shaped = {path: t for path, t in tensors.items() if t.dim() > seq_dim}
        if not shaped:
            raise ValueError(f"Context parallelism found no tensor with a sequence dim {seq_dim} in the batch"
                             f" (tensors: {_shapes(tensors)}); set cp_seq_dim or cp_batch_keys.")
        length = next(iter(shaped.values())).size(seq_dim)
        return [path for path, t in shaped.items() if t.size(seq_dim) == length], length
    paths = [str(k) for k in keys]
    for path in paths:
        if path not in tensors or tensors[path].dim() <= seq_dim:
            raise ValueError(f"cp_batch_keys: {path!r} is not a tensor with a sequence dim {seq_dim} in the batch"
                             f" (tensors: {_shapes(tensors)}).")
    lengths = {path: tensors[path].size(seq_dim) for path in paths}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"cp_batch_keys name tensors of different lengths on dim {seq_dim}: {lengths}.")
    return paths, lengths[paths[0]]


def evidently_no_sequence(tensor: Tensor, seq_dim: int) -> Optional[str]:
    """Why dim ``seq_dim`` of ``tensor`` is evidently no sequence, or None. Sequences come as token ids (integers,
    ``[batch, tokens]``) or their embeddings (``[batch, tokens, features]``): a floating-point ``[batch, n]``
    tensor holds features, and one of 4 or more dims holds an image's (or a volume's) channels on dim 1."""
    if seq_dim != 1 or not tensor.is_floating_point():
        return None
    if tensor.dim() == 2:
        return "a floating-point [batch, features] tensor, whose dim 1 holds features"
    if tensor.dim() >= 4:
        return f"a floating-point tensor of {tensor.dim()} dims, whose dim 1 holds an image's channels"
    return None


def _shapes(tensors: dict[str, Tensor]) -> str:
    return ", ".join(f"{path or 'batch'}: {tuple(t.shape)}" for path, t in tensors.items()) or "none"

