"""Checkpoint integrity: every file of a checkpoint directory has its size and CRC-32 in ``checksums.json``.

Each rank checksums the shard files it wrote right after writing them (through a memory map; in an asynchronous
save the writer process checksums what it wrote); loading verifies them first, every rank a share of the files,
and every rank refuses a damaged checkpoint with the same message, naming each damaged file and the tensors in
it, before any state changes.
``python -m lightning_4d.verify_checkpoint DIR`` checks a directory offline (:mod:`.verify`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_4d.checkpoint.writer_process import fingerprint

CHECKSUM_FILE = "checksums.json"
META_FILE = "meta.pt"  # Lightning's own state in a checkpoint directory (:mod:`.sharded`)


class CorruptCheckpointError(ValueError):
    """A checkpoint file does not match the size or checksum it was written with (or is missing)."""


def _write_checksums(directory: Path, is_writer: bool, group: Optional[dist.ProcessGroup] = None,
                     known: Optional[Mapping[str, Any]] = None) -> None:
    """Collective over ``group`` (default: the world): each rank checksums the shard files it wrote
    (``__<rank>_*``; those in ``known`` were checksummed by whoever wrote them); the writer also its own index and
    ``meta.pt``, gathers everyone's (only the writer holds them all, as DCP's coordinator holds every plan) and
    writes ``checksums.json``."""
    known = known or {}
    rank = dist.get_rank() if dist.is_initialized() else None
    mine = {}
    for file in sorted(directory.iterdir()):
        if file.name == CHECKSUM_FILE or not file.is_file():
            continue
        own_shard = rank is None or file.name.startswith(f"__{rank}_")
        if own_shard or (is_writer and not file.name.startswith("__")):
            mine[file.name] = known[file.name] if file.name in known else fingerprint(file)
    everyone: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group) if is_writer else None
        dist.gather_object(mine, everyone, dst=0, group=group)  # the writer is global rank 0
    if is_writer:
        _save_checksums(directory, {name: value for part in everyone for name, value in part.items()})


def _save_checksums(directory: Path, files: Mapping[str, Any]) -> None:
    text = json.dumps({"algorithm": "crc32", "files": dict(sorted(files.items()))}, indent=1)
    (directory / CHECKSUM_FILE).write_text(text)


def _copy_checksums(source: Path, directory: Path) -> None:
    """``directory`` holds ``source``'s files (linked) but its own ``meta.pt``: the same checksums, that one new."""
    files = dict(expected_files(source) or {})
    files[META_FILE] = fingerprint(directory / META_FILE)
    _save_checksums(directory, files)


def _tensors_by_file(directory: Path) -> dict[str, list[str]]:
    """Which tensors (by checkpoint key) have bytes in each shard file, from DCP's index (best effort: the
    index itself may be the damaged file)."""
    try:
        stored = dcp.FileSystemReader(directory).read_metadata()
    except Exception:  # noqa: BLE001  a damaged index: files are still named, tensors not
        return {}
    tensors = {key for key, meta in stored.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    names: dict[str, set[str]] = {}
    for index, info in (stored.storage_data or {}).items():
        if index.fqn in tensors:
            names.setdefault(info.relative_path, set()).add(index.fqn)
    # The model's weights first, then optimizer state.
    return {file: sorted(keys, key=lambda k: (not k.startswith("state_dict."), k)) for file, keys in names.items()}


def _problems(directory: Path, files: Mapping[str, Mapping[str, Any]]) -> list[str]:
    problems = []
    for name, expected in files.items():
        file = directory / name
        if not file.is_file():
            problems.append(f"{name}: missing")
            continue
        size = file.stat().st_size
        if size != expected["size"]:
            problems.append(f"{name}: {size} bytes, written with {expected['size']} (truncated or overwritten)")
        elif fingerprint(file)["crc32"] != expected["crc32"]:
            problems.append(f"{name}: checksum mismatch (the bytes changed after writing)")
    return problems


def expected_files(directory: Path) -> Optional[dict[str, Any]]:
    """The file list of ``checksums.json``; None for a checkpoint written before checksums existed."""
    file = directory / CHECKSUM_FILE
    if not file.is_file():
        return None
    try:
        files = json.loads(file.read_text())["files"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(f"Checkpoint {directory} is damaged: {CHECKSUM_FILE} is unreadable"
                                     f" ({error}); nothing was loaded.") from None
    return files


def describe_problems(directory: Path, problems: list[str]) -> str:
    """One line for the user: each damaged file with the tensors it holds, and what to do."""
    tensors = _tensors_by_file(directory)
    lines = []
    for problem in problems:
        name = problem.split(":", 1)[0]
        held = tensors.get(name)
        if held:
            shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more tensors" if len(held) > 8 else "")
            problem += f"; it holds {shown}"
        lines.append(problem)
    return (f"Checkpoint {directory} is damaged, refusing to load it (nothing was loaded): " + " | ".join(lines)
            + ". Restore the files from a copy, or resume from an older checkpoint.")


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> list[str]:
    """The problems with the files of a checkpoint directory (empty when intact). ``share=(i, n)`` checks only
    every n-th file from the i-th (a rank's part of a collective check)."""
    directory = Path(path)
    files = expected_files(directory)
    if files is None:
        return []
    index, count = share
    names = sorted(files)[index::count]
    return _problems(directory, {name: files[name] for name in names})


def verify_collective(path: str | os.PathLike) -> None:
    """Every rank checks a share of the files and every rank raises :class:`CorruptCheckpointError` with the
    same message if any file is damaged (a collective when a process group exists)."""
    directory = Path(path)
    if expected_files(directory) is None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[lightning-4d] {directory} has no {CHECKSUM_FILE} (written before checksums): loading it"
                  " unverified.", file=sys.stderr, flush=True)
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine = verify(directory, (dist.get_rank(), dist.get_world_size()))
        problems = []
        if _total(len(mine)):  # agreed by a count; every rank's list travels only when something is damaged
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            problems = sorted(p for part in everyone for p in part)
    else:
        problems = verify(directory)
    if problems:
        raise CorruptCheckpointError(describe_problems(directory, problems))



def _total(count: int) -> int:
    """``count`` summed over every rank (on the device NCCL needs, on the host under gloo)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())
