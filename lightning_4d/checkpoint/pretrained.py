"""Weights to start from, in the forms people have them, read slice by slice into any layout.

:func:`load_pretrained` takes

- a Hugging Face directory (``save_pretrained``: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
  with ``model.safetensors.index.json``), planned by torch's ``HuggingFaceStorageReader`` and read with plain
  reads of each rank's slices (:mod:`~lightning_4d.checkpoint.safetensors_slices`: no memory map);
- a torch DCP directory (``.metadata`` and ``*.distcp`` files, no lightning-4d ``meta.pt``), read with torch's
  ``FileSystemReader``;
- a file holding a Lightning checkpoint or a plain ``state_dict``, memory-mapped
  (``torch.load(mmap=True, weights_only=True)``).

Every rank reads only what it holds: ``dcp.load`` into the live, already sharded state dict plans one read per
local chunk (a tensor-parallel or FSDP shard, only this pipeline stage's tensors; a replicated tensor whole),
and from a memory-mapped file each rank copies its own part of one tensor at a time. No rank gathers the model.

The file's keys are matched to the module's by a prefix found automatically: the module path under which the
file's keys are the module's (``model.`` for a LightningModule that holds the Hugging Face model as
``self.model``), and a common first component of the file's keys that the module lacks (``state_dict.``).
Where no prefix or more than one fits, the error names the candidates and ``FourDStrategy(init_from_prefix=...)``.

Before any weight changes every rank checks every file's header and every key and shape; the problems, if any,
are gathered from all ranks and every rank raises the same :class:`PretrainedWeightsError`, naming the files,
the keys and the shapes.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_4d.checkpoint.safetensors_slices import SafetensorsSliceReader
from lightning_4d.checkpoint.sharded import META_FILE, PARTIAL_SUFFIX, _load_shards, _set_model_state, model_state, read_meta

HF_INDEX = "model.safetensors.index.json"
SAFETENSORS = ".safetensors"


class PretrainedWeightsError(ValueError):
    """Weights to start from that cannot be loaded into the model; raised alike on every rank, before any weight
    changed."""


@dataclass(frozen=True)
class _Stored:
    shape: tuple[int, ...]
    file: str  # where the tensor is (its file's name, or the directory for DCP)


@dataclass
class _Source:
    kind: str  # "Hugging Face directory", "torch DCP directory", "file"
    path: Path
    stored: dict[str, _Stored]
    problems: list[str]  # missing or damaged files
    tensors: Optional[Mapping[str, torch.Tensor]] = None  # the file's tensors
    mapped: bool = False  # they are memory-mapped (their pages can be dropped once read)


def is_hugging_face_dir(path: Path) -> bool:
    """``path`` is a directory of safetensors files (``save_pretrained``'s output), with or without its index."""
    return path.is_dir() and ((path / HF_INDEX).is_file() or any(path.glob(f"*{SAFETENSORS}")))


def _hugging_face(path: Path) -> _Source:
    from safetensors import SafetensorError, safe_open

    problems: list[str] = []
    present = sorted(p.name for p in path.glob(f"*{SAFETENSORS}"))
    listed: dict[str, str] = {}
    if (path / HF_INDEX).is_file():
        try:
            listed = dict(json.loads((path / HF_INDEX).read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"{HF_INDEX} is unreadable ({error})")
        for name in sorted(set(listed.values()) - set(present)):
            keys = sorted(key for key, file in listed.items() if file == name)
            problems.append(f"{name} is missing (the index lists {len(keys)} tensors in it: {_few(keys)})")
    stored: dict[str, _Stored] = {}
    for name in present:
        try:
            with safe_open(str(path / name), framework="pt") as file:
                for key in file.keys():
                    stored[key] = _Stored(tuple(file.get_slice(key).get_shape()), name)
        except (SafetensorError, OSError) as error:
            problems.append(f"{name} is damaged or truncated ({error})")
    for key, name in sorted(listed.items()):
        if name in present and key not in stored and not any(name in p for p in problems):
            problems.append(f"{name} lacks {key!r}, which the index places in it")
    if not present and not problems:
        problems.append(f"no {SAFETENSORS} file")
    return _Source("Hugging Face directory", path, stored, problems)


def _torch_dcp(path: Path) -> _Source:
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stored = {key: _Stored(tuple(value.size), ".metadata") for key, value in metadata.items()
              if isinstance(value, TensorStorageMetadata)}
    return _Source("torch DCP directory", path, stored, [])


def _state_dict_file(path: Path) -> _Source:
    try:
        loaded, mapped = torch.load(path, map_location="cpu", weights_only=True, mmap=True), True
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        # A file in torch's legacy (pre-1.6) format cannot be memory-mapped: read it whole.
        loaded, mapped = torch.load(path, map_location="cpu", weights_only=True), False
    full = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
    if not isinstance(full, Mapping) or not all(isinstance(v, torch.Tensor) for v in full.values()):
        raise PretrainedWeightsError(f"{path} holds neither a Lightning checkpoint nor a state_dict of tensors.")
    stored = {key: _Stored(tuple(value.shape), path.name) for key, value in full.items()}
    return _Source("file", path, stored, [], tensors=full, mapped=mapped)


def _few(keys: list[str], most: int = 8) -> str:
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


# ------------------------------------------------------------------------------------------- key names


@dataclass(frozen=True)
class KeyMap:
    """A file key ``strip + rest`` is the module key ``add + rest``."""

    strip: str = ""
    add: str = ""

    def module_key(self, file_key: str) -> Optional[str]:
        return self.add + file_key[len(self.strip):] if file_key.startswith(self.strip) else None

    def describe(self) -> str:
        if not self.strip and not self.add:
            return "the file's keys are the module's"
        return (f"the file's keys{f' without {self.strip!r}' if self.strip else ''} are the module's"
                f"{f' under {self.add!r}' if self.add else ''}")


def match_keys(stored: Collection[str], model_keys: Collection[str], modules: Collection[str],
               prefix: Optional[str] = None) -> tuple[KeyMap, list[str]]:
    """The :class:`KeyMap` that makes the most of ``stored`` module keys, and why there is none (a list of
    problems, empty when one fits). ``modules``: the module's submodule names, candidates for the prefix the
    module's keys have and the file's lack; ``prefix``: that prefix named by the user."""
    firsts = {key.split(".", 1)[0] + "." for key in stored if "." in key}
    strips = [""] + sorted(firsts) if len(firsts) == 1 else [""]
    if prefix is not None:
        adds = [prefix if not prefix or prefix.endswith(".") else prefix + "."]
    else:
        adds = [""] + [name + "." for name in modules if name]
    model = set(model_keys)
    scored = []
    for add in adds:
        for strip in strips:
            keymap = KeyMap(strip, add)
            score = sum(1 for key in stored if keymap.module_key(key) in model)
            if score:
                scored.append((score, keymap))
    if not scored:
        hint = (f"with the prefix {prefix!r}" if prefix is not None else "under any prefix of its module names")
        return KeyMap(add=adds[0]), [f"none of the file's keys (e.g. {_few(sorted(stored), 3)}) is a key of the"
                                     f" model (e.g. {_few(sorted(model), 3)}) {hint}"]
    best = max(score for score, _ in scored)
    winners, seen = [], set()
    for score, keymap in scored:  # two prefixes that give the same key names are one answer
        names = frozenset((key, keymap.module_key(key)) for key in stored)
        if score == best and names not in seen:
            seen.add(names)
            winners.append(keymap)
    if len(winners) > 1 and prefix is None:
        names = ", ".join(repr(k.add) for k in winners)
        return winners[0], [f"the file's keys fit the model under several prefixes ({names}): name the one with"
                            " FourDStrategy(init_from_prefix=...)"]
    return winners[0], []


# ------------------------------------------------------------------------------------------- checking


def _problems(source: _Source, keymap: KeyMap, held: Mapping[str, Any], whole: Collection[str],
              aliases: Mapping[str, str], strict: bool) -> list[str]:
    """Missing, unexpected and mis-shaped tensors, each with its file."""
    mapped = {keymap.module_key(key): key for key in source.stored}
    mapped.pop(None, None)
    missing = sorted(key for key in whole if key not in mapped and aliases.get(key) not in mapped)
    problems = []
    if missing:
        problems.append(f"missing keys: {missing}")
    if strict:
        by_file: dict[str, list[str]] = {}
        for key, stored in source.stored.items():
            if keymap.module_key(key) not in whole:
                by_file.setdefault(stored.file, []).append(key)
        if by_file:
            problems.append("unexpected keys: " + ", ".join(f"{sorted(keys)} in {file}"
                                                            for file, keys in sorted(by_file.items())))
    shapes = [f"{key}: checkpoint {source.stored[mapped[key]].shape} vs model {tuple(value.shape)}"
              f" in {source.stored[mapped[key]].file}"
              for key, value in held.items()
              if key in mapped and isinstance(value, torch.Tensor)
              and source.stored[mapped[key]].shape != tuple(value.shape)]
    if shapes:
        problems.append(f"wrong shapes: {shapes}")
    return problems


def _agree(problems: list[str]) -> list[str]:
    """Every rank's problems on every rank (a collective when a process group exists), so that all raise
    together even where only some ranks saw a problem (their pipeline stage's keys)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return problems
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return list(dict.fromkeys(problem for part in everyone for problem in part))


def _aliases(model: nn.Module) -> dict[str, str]:
    """Each name of a tied parameter -> another name of it (``save_pretrained`` writes a tied weight once)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: other for group in names.values() if len(group) > 1 for name in group for other in group
            if other != name}


# ------------------------------------------------------------------------------------------- loading


def load_weights(path: str | os.PathLike, model: nn.Module, strict: bool = True,
                 whole_model: Optional[Collection[str]] = None, prefix: Optional[str] = None) -> None:
    """Only the weights, into any layout, each rank reading only what it holds: from a lightning-4d checkpoint
    directory (verified first, :func:`~lightning_4d.checkpoint.sharded.load`), or whatever
    :func:`load_pretrained` takes. ``whole_model`` and ``prefix`` as there."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX) or (path / META_FILE).is_file():
        if not (path / META_FILE).is_file():
            read_meta(path)  # raises: an interrupted save
        _load_shards(path, model, [], strict, whole_model)  # verifies every file (meta.pt too) first
        return
    load_pretrained(path, model, strict, whole_model, prefix)


def load_pretrained(path: str | os.PathLike, model: nn.Module, strict: bool = True,
                    whole_model: Optional[Collection[str]] = None, prefix: Optional[str] = None) -> None:
    """Load the weights at ``path`` (a Hugging Face directory, a torch DCP directory, a Lightning checkpoint or
    ``state_dict`` file) into ``model``, whatever its layout; see the module docstring. Collective when a
    process group exists. ``whole_model``: under pipelining, every state-dict key of the whole model;
    ``prefix``: the module path the file's keys are relative to (found automatically when None)."""
    path = Path(path)
    if is_hugging_face_dir(path):
        source = _hugging_face(path)
    elif path.is_dir() and (path / ".metadata").is_file():
        source = _torch_dcp(path)
    elif path.is_dir():
        raise PretrainedWeightsError(
            f"{path} is neither a Hugging Face directory (*{SAFETENSORS}, {HF_INDEX}), a torch DCP directory"
            " (.metadata) nor a lightning-4d checkpoint (meta.pt).")
    else:
        source = _state_dict_file(path)
    held = model_state(model)
    whole = set(whole_model) if whole_model is not None else set(held)
    problems = [f"{p}" for p in source.problems]
    keymap = KeyMap()
    if not problems:
        modules = [name for name, _ in model.named_modules()]
        keymap, problems = match_keys(list(source.stored), whole | set(held), modules, prefix)
        if not problems:
            problems = _problems(source, keymap, held, whole, _aliases(model), strict)
    problems = _agree(problems)
    if problems:
        raise PretrainedWeightsError(
            f"The {source.kind} {path} does not fit the model, nothing was loaded: " + "; ".join(problems)
            + (f" ({keymap.describe()})" if source.stored else "") + ". Start from weights saved from this"
            " model's architecture (or set strict_loading=False on the LightningModule to ignore unexpected keys).")
    file_key = {keymap.module_key(key): key for key in source.stored}
    targets = {key: value for key, value in held.items() if key in file_key}
    if source.tensors is not None:
        _copy_own_parts(source.tensors, file_key, targets, source.mapped)
    else:
        reader = (SafetensorsSliceReader(str(path)) if source.kind.startswith("Hugging")
                  else dcp.FileSystemReader(path))
        state = {file_key[key]: value for key, value in targets.items()}
        dcp.load(state, storage_reader=reader)
        targets = {key: state[file_key[key]] for key in targets}
    _set_model_state(model, targets, held, strict=False)


def _copy_own_parts(tensors: Mapping[str, torch.Tensor], file_key: Mapping[str, str],
                    targets: Mapping[str, Any], mapped: bool) -> None:
    """From a state dict, each target's own part, one tensor at a time; when it is memory-mapped only its pages
    are read, and they leave the resident set once copied."""
    with torch.no_grad():
        for key, target in targets.items():
            source = tensors[file_key[key]]
            if isinstance(target, DTensor):
                part = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(part.to_local())
                del part
            else:
                target.copy_(source)
            if mapped:
                release_pages(source)


_MADV_DONTNEED = 4  # Linux


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the pages of a memory-mapped, read-only tensor (never anonymous memory: it would read back zeros) from this process's resident set (Linux; elsewhere
    nothing). A private file mapping keeps every page a rank touched resident until it is unmapped, which for a
    state dict is after the whole load: a rank reading its slices of every tensor would show most of the file.
    Dropped pages stay in the page cache and are read again from it if touched, so nothing is lost."""
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
