"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Every rank writes only what it holds (a replicated tensor is written once), so no rank ever assembles
the whole model. Tensors are keyed by their fully qualified names, which is what lets a checkpoint saved
in one layout load into another.

A checkpoint is written into ``<path>.partial`` and renamed to ``<path>`` only after every rank finished:
a crash while saving leaves no directory at ``<path>`` that a resume could pick up half-written.
Lightning's own metadata (loops, callbacks, schedulers) goes into ``meta.pt`` and is read back with
``weights_only=True``, so loading never executes code from the file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

META_FILE = "meta.pt"
PARTIAL_SUFFIX = ".partial"


def model_state(model: nn.Module) -> dict[str, Any]:
    return get_model_state_dict(model)


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(checkpoint: dict[str, Any], path: str | os.PathLike, is_writer: bool) -> None:
    """Collective: every rank calls it with the same ``path``."""
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if is_writer and partial.exists():
        shutil.rmtree(partial)
    _barrier()
    checkpoint = dict(checkpoint)
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{index}"] = state
    dcp.save(tensors, checkpoint_id=partial)
    if is_writer:
        torch.save(_plain(checkpoint), partial / META_FILE)
    _barrier()
    if is_writer:
        if path.exists():
            remove(path)
        partial.rename(path)
    _barrier()


def load(
    path: str | os.PathLike, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load in place into ``model`` and ``optimizers`` (whatever their layout); returns Lightning's metadata."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a lightning-4d checkpoint directory (no {META_FILE}). A directory ending in"
            f" {PARTIAL_SUFFIX!r} is an interrupted save and cannot be resumed from."
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"state_dict": get_model_state_dict(model)}
    _check_model_fits(state["state_dict"], stored, path, strict)
    for index, optimizer in enumerate(optimizers):
        optimizer_state = get_optimizer_state_dict(model, optimizer)
        # A parameter that never had a gradient has no optimizer state in the file; leave it without one.
        prefix = f"optimizer_{index}.state."
        for fqn in list(optimizer_state["state"]):
            if not any(f"{prefix}{fqn}.{name}" in stored for name in optimizer_state["state"][fqn]):
                del optimizer_state["state"][fqn]
        state[f"optimizer_{index}"] = optimizer_state
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{index}"], options=StateDictOptions(strict=False))
    return meta


def _check_model_fits(model_state: dict[str, Any], stored: Mapping[str, Any], path: Path, strict: bool) -> None:
    """Name every missing, unexpected or mis-shaped tensor at once, instead of DCP's first-key error."""
    saved = {key[len("state_dict."):]: meta for key, meta in stored.items() if key.startswith("state_dict.")}
    missing = sorted(set(model_state) - set(saved))
    unexpected = sorted(set(saved) - set(model_state)) if strict else []
    shapes = [
        f"{key}: checkpoint {tuple(saved[key].size)} vs model {tuple(value.shape)}"
        for key, value in model_state.items()
        if key in saved and isinstance(value, torch.Tensor) and tuple(saved[key].size) != tuple(value.shape)
    ]
    if missing or unexpected or shapes:
        parts = [f"missing keys: {missing}"] * bool(missing) + [f"unexpected keys: {unexpected}"] * bool(unexpected)
        parts += [f"wrong shapes: {shapes}"] * bool(shapes)
        raise ValueError(f"The checkpoint {path} does not fit the model: " + "; ".join(parts)
                         + ". Load it into the module it was saved from (or set strict_loading=False"
                         " on the LightningModule to ignore unexpected keys).")


def load_weights(path: str | os.PathLike, model: nn.Module, strict: bool = True) -> None:
    """Only the weights, into any layout, from a lightning-4d checkpoint directory, a Lightning checkpoint
    file, or a file holding a plain ``state_dict``."""
    path = Path(path)
    model_state = get_model_state_dict(model)
    if path.is_dir():
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        _check_model_fits(model_state, stored, path, strict)
        state = {"state_dict": model_state}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
        return
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    full = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
    if not isinstance(full, Mapping) or not all(isinstance(v, torch.Tensor) for v in full.values()):
        raise ValueError(f"{path} holds neither a Lightning checkpoint nor a state_dict of tensors.")
    _check_model_fits(model_state, {f"state_dict.{k}": _Shape(v.shape) for k, v in full.items()}, path, strict)
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True, strict=strict))


class _Shape:
    """Stands in for DCP's tensor metadata where only ``size`` is read."""

    def __init__(self, size: torch.Size) -> None:
        self.size = size


def remove(path: str | os.PathLike) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _plain(value: Any) -> Any:
    """Dict subclasses (Lightning's ``AttributeDict`` hyper-parameters) as plain dicts, loadable weights-only."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as plain tensors on every rank (for export and tests of small models)."""
    state = get_model_state_dict(model)
    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}
