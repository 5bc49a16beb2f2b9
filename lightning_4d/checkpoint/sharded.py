"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Every rank writes only what it holds (a replicated tensor is written once), so no rank ever assembles
the whole model. Tensors are keyed by their fully qualified names, which is what lets a checkpoint saved
in one layout load into another.

A checkpoint is written into ``<path>.partial`` and renamed to ``<path>`` only after every rank finished:
a crash while saving leaves no directory at ``<path>`` that a resume could pick up half-written (nor one
that Lightning's ``ckpt_path="last"`` or a ``*.ckpt`` glob would find: the suffix is not ``.ckpt``).
Lightning's own metadata (loops, callbacks, schedulers) goes into ``meta.pt`` and is read back with
``weights_only=True``, so loading never executes code from the file.

Every file is checksummed as it is written and verified before loading (:mod:`.integrity`).

Under pipeline parallelism a rank's module holds only its stage (other stages' parameters are not
parameters there at all), so each stage writes exactly the tensors it owns and nothing stale; a weight kept
by the first and the last stage (tied embedding and head) is written once, as any replicated tensor.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_4d.checkpoint.integrity import (CHECKSUM_FILE, META_FILE, _copy_checksums, _write_checksums,
                                              verify_collective)

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"

def model_state(model: nn.Module) -> dict[str, Any]:
    """The tensors this rank holds, by full parameter name (DTensor shards stay shards). A model whose modules'
    state-dict hooks rename keys (torchtitan's fused ``wqkv`` is saved as ``wq``/``wk``/``wv``) gives its own
    ``state_dict()``, as torchtitan's checkpointer takes it: torch's ``get_model_state_dict`` looks every key
    up as an attribute and fails on those."""
    state = model.state_dict()
    return state if _renamed_by_hooks(model, state) else get_model_state_dict(model)


def _renamed_by_hooks(model: nn.Module, state: Mapping[str, Any]) -> bool:
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return any(key not in names and not key.endswith("._extra_state") for key in state)  # get_extra_state()'s key


def _set_model_state(model: nn.Module, state: dict[str, Any], held: Mapping[str, Any], strict: bool,
                     full: bool = False) -> None:
    """``set_model_state_dict``, or the model's own ``load_state_dict`` (whose hooks undo the renaming) where
    :func:`model_state` took its own ``state_dict()``; ``held`` is what :func:`model_state` gave. ``full``: plain
    tensors, the same on every rank; where the model holds a DTensor each rank takes its own part of them."""
    if not _renamed_by_hooks(model, held):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=full, strict=strict))
        return
    if full:
        state = {key: distribute_tensor(value, held[key].device_mesh, held[key].placements, src_data_rank=None)
                 if isinstance(held.get(key), DTensor) and not isinstance(value, DTensor) else value
                 for key, value in state.items()}
    model.load_state_dict(state, strict=strict)


# Optimizer state flattened to one entry per parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``):
# nested ``param_groups`` would be one object per rank under a single key, and when pipeline stages hold
# different parameters only one rank's copy would be kept.
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, one entry per parameter name and state (see ``_FLAT_OPTIMIZER``), under
    the module's own names: a parameter held stacked for several of the module's (expert parallelism's
    hand-written experts, ``experts.gate_proj__weight``) gives one whole entry per original name
    (``experts.3.gate_proj.weight``), as one process saves them, so that any layout resumes any other."""
    flat = get_optimizer_state_dict(model, optimizer, options=_FLAT_OPTIMIZER)
    for name, (param, names) in _stacked_parameters(model).items():
        for key in [k for k in flat if k.startswith((f"state.{name}.", f"param_groups.{name}."))]:
            value = flat.pop(key)
            kind, suffix = key.split(".", 1)[0], key[len(key.split(".", 1)[0]) + len(name) + 2:]
            split = kind == "state" and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            for index, own in enumerate(names):
                flat[f"{kind}.{own}.{suffix}"] = whole[index].clone() if split else whole
    return flat


def _stacked_parameters(model: nn.Module) -> dict[str, tuple[nn.Parameter, list[str]]]:
    """Parameters that hold several of the module's own, stacked on dim 0: full name -> (parameter, the module's
    full names of its parts), from every submodule that says so (a ``module_keys()`` method)."""
    found = {}
    for fqn, m in model.named_modules():
        keys = getattr(m, "module_keys", None)
        if callable(keys):
            prefix = f"{fqn}." if fqn else ""
            for name, names in keys().items():
                found[prefix + name] = (m.get_parameter(name), [prefix + own for own in names])
    return found


def _restack_optimizer_state(model: nn.Module, flat: dict[str, Any]) -> dict[str, Any]:
    """:func:`optimizer_state`'s renaming undone on loaded values: each stacked parameter's entries stacked
    again and placed as the parameter is (this rank's part of a DTensor)."""
    for name, (param, names) in _stacked_parameters(model).items():
        for kind in ("state", "param_groups"):
            first = f"{kind}.{names[0]}."
            for suffix in [k[len(first):] for k in list(flat) if k.startswith(first)]:
                values = [flat.pop(f"{kind}.{own}.{suffix}") for own in names]
                value = values[0]
                if kind == "state" and isinstance(value, torch.Tensor) and value.dim() and \
                        (len(names), *value.shape) == tuple(param.shape):
                    value = torch.stack(values)
                    if isinstance(param, DTensor):
                        value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                  src_data_rank=None)
                flat[f"{kind}.{name}.{suffix}"] = value
    return flat


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(checkpoint: dict[str, Any], path: str | os.PathLike, is_writer: bool) -> None:
    """Collective: every rank calls it with the same ``path``; returns when the checkpoint is complete there."""
    path = Path(path)
    partial = partial_path(path)
    if is_writer:
        remove(partial)  # an interrupted save's leftover
    _barrier()
    tensors, meta = split(checkpoint)
    write(tensors, meta, partial, is_writer)
    _barrier()
    if is_writer:
        publish(partial, path)
    _barrier()


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is complete: no resume or ``*.ckpt`` glob finds it there."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


def split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint as DCP's tensors (``state_dict``, ``optimizer_<i>``) and the rest (``meta.pt``)."""
    meta = dict(checkpoint)
    tensors = {"state_dict": meta.pop("state_dict")}
    for index, state in enumerate(meta.pop("optimizer_states", [])):
        tensors[f"optimizer_{index}"] = state
    return tensors, meta


# Repeated saves of the same layout reuse DCP's plans (the coordinator's gather and scatter of every rank's plan
# shrink to an empty message per rank once nothing changed).
def _planner() -> DefaultSavePlanner:
    return DefaultSavePlanner(enable_plan_caching=True)


def write(tensors: dict[str, Any], meta: dict[str, Any], partial: Path, is_writer: bool,
          group: Optional[dist.ProcessGroup] = None, storage_writer: Optional[dcp.StorageWriter] = None) -> None:
    """Collective over ``group``: every rank's shards, the writer's ``meta.pt``, and every file's checksum,
    into the ``.partial`` directory. When it returns on the writer, every rank's files are written.
    ``storage_writer``: DCP's file writer, or one that writes the same files elsewhere (a writer process)."""
    dcp.save(tensors, checkpoint_id=partial, planner=_planner(), process_group=group, storage_writer=storage_writer)
    if is_writer:
        torch.save(_plain(meta), partial / META_FILE)
    _write_checksums(partial, is_writer, group, known=getattr(storage_writer, "fingerprints", None))


def publish(partial: Path, path: Path) -> None:
    """The writer renames a complete ``.partial`` directory into place. Overwriting (``last.ckpt``), the two swap
    names in one step where the system can (Linux's ``renameat2``), so ``path`` is at every moment the old or the
    new complete checkpoint. Elsewhere (another system, or a file system without the swap) the old one steps aside
    first: a crash between the two renames leaves it complete under ``<name>.replaced``, to rename back by hand."""
    if (path.exists() or path.is_symlink()) and _exchange(partial, path):
        remove(partial)  # the old checkpoint, now under the partial's name
        return
    replaced = path.with_name(path.name + REPLACED_SUFFIX)
    if path.exists() or path.is_symlink():
        remove(replaced)
        path.rename(replaced)
    partial.rename(path)
    remove(replaced)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths' names atomically; False where the system cannot (not Linux, an old kernel or libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        exchange = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, rename_exchange = -100, 2
    if exchange(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # a kernel or file system without exchange
        return False
    raise OSError(error, os.strerror(error), f"{first} <-> {second}")


def publish_copy(source: Path, path: Path, meta: dict[str, Any]) -> None:
    """The writer publishes, under ``path``, a checkpoint of the tensors ``source`` holds and its own
    ``meta``: the shard files hard-linked (copied where the file system has no hard links), not written again."""
    partial = partial_path(path)
    remove(partial)
    partial.mkdir()
    for file in source.iterdir():
        if file.name not in (META_FILE, CHECKSUM_FILE):
            try:
                os.link(file, partial / file.name)
            except OSError:
                shutil.copy2(file, partial / file.name)
    torch.save(_plain(meta), partial / META_FILE)
    _copy_checksums(source, partial)
    publish(partial, path)


def publish_symlink(target: Path, path: Path) -> None:
    """The writer points ``path`` at ``target`` (ModelCheckpoint's ``save_last="link"``) in one rename, so
    that ``path`` is never missing or dangling on the way."""
    temporary = path.with_name(path.name + ".link")
    remove(temporary)
    os.symlink(os.path.relpath(target, path.parent), temporary)
    if path.is_dir() and not path.is_symlink():
        replaced = path.with_name(path.name + REPLACED_SUFFIX)
        remove(replaced)
        path.rename(replaced)
        temporary.rename(path)
        remove(replaced)
    else:
        os.replace(temporary, path)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's metadata of a checkpoint directory (read weights-only: no code from the file runs)."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a lightning-4d checkpoint directory (no {META_FILE}). A directory ending in"
            f" {PARTIAL_SUFFIX!r} is an interrupted save and cannot be resumed from."
        )
    return torch.load(path / META_FILE, map_location="cpu", weights_only=True)


def load(path: str | os.PathLike, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True,
         whole_model: Optional[Collection[str]] = None) -> dict[str, Any]:
    """Load in place into ``model`` and ``optimizers`` (whatever their layout); returns Lightning's metadata.
    A damaged checkpoint raises :class:`CorruptCheckpointError` on every rank before anything is loaded.

    ``whole_model``: when ``model`` is one pipeline stage, every state-dict key of the whole model (the
    pipeline plan knows them), so that keys held by other stages are not reported as unexpected.
    """
    path = Path(path)
    if not (path / META_FILE).is_file():
        read_meta(path)  # raises: not a checkpoint directory
    verify_collective(path)
    meta = read_meta(path)
    _load_shards(path, model, optimizers, strict, whole_model, verified=True)
    return meta


def _load_shards(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool,
                 whole_model: Optional[Collection[str]], verified: bool = False) -> None:
    if not verified:
        verify_collective(path)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"state_dict": model_state(model)}
    _check_model_fits(state["state_dict"], stored, path, strict, whole_model)
    for index, optimizer in enumerate(optimizers):
        flat = optimizer_state(model, optimizer)
        # A parameter that never had a gradient has no optimizer state in the file; leave it without one.
        with_state = _names_with_state(stored, f"optimizer_{index}.state.")
        stacked = _stacked_parameters(model)
        for name, param in model.named_parameters():
            name = _state_dict_name(name)
            names = stacked[name][1] if name in stacked else [name]
            if not any(own in with_state for own in names) and param in optimizer.state:
                del optimizer.state[param]
                for key in [k for k in flat if k.startswith(tuple(f"state.{own}." for own in names))]:
                    del flat[key]
        state[f"optimizer_{index}"] = flat
    dcp.load(state, checkpoint_id=path)
    _set_model_state(model, state["state_dict"], state["state_dict"], strict)  # loaded in place: its keys are held's
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, _restack_optimizer_state(model, state[f"optimizer_{index}"]),
                                 options=StateDictOptions(strict=False, flatten_optimizer_state_dict=True))


# Wrappers that keep their module under an attribute the state dict leaves out (activation checkpointing's,
# torch.compile's, FSDP1's): a parameter's name as torch's state-dict functions give it.
_WRAPPER_ATTRIBUTES = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def _state_dict_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_ATTRIBUTES)


def _names_with_state(stored: Mapping[str, Any], prefix: str) -> set[str]:
    """Parameter names that have optimizer state in the file (its keys are ``<prefix><name>.<state>...``)."""
    names = set()
    for key in stored:
        if key.startswith(prefix):
            parts = key[len(prefix):].split(".")
            names.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return names


def _check_model_fits(model_state: dict[str, Any], stored: Mapping[str, Any], path: Path, strict: bool,
                      whole_model: Optional[Collection[str]] = None) -> None:
    """Name every missing, unexpected or mis-shaped tensor at once, instead of DCP's first-key error.
    ``whole_model``: under pipelining, the keys of the whole model (this rank loads only its stage's)."""
    saved = {key[len("state_dict."):]: meta for key, meta in stored.items() if key.startswith("state_dict.")}
    missing = sorted(set(model_state) - set(saved))
    unexpected = sorted(set(saved) - set(whole_model or model_state)) if strict else []
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


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or a single file)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
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


def full_model_state(model: nn.Module, pp_group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """The whole model as plain tensors on every rank (for export and tests of small models); a collective
    over the tensor-parallel ranks and, when ``model`` is one pipeline stage, over ``pp_group``'s stages."""
    state = model_state(model)
    state = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}
    if pp_group is None:
        return state
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, {key: value.detach().cpu() for key, value in state.items()}, group=pp_group)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    merged: dict[str, torch.Tensor] = {}
    for part in stages:
        merged.update(part)  # a weight kept by two stages (tied embedding and head) is equal on both
    return {key: value.to(device) for key, value in merged.items()}
