"""Cutting an unchanged module into pipeline stages at its list of repeated blocks.

The block list stays where it is, holding only this rank's blocks under their original names, so that the
module's own ``for layer in self.layers`` loop runs exactly the blocks of the stage being executed, and
parameter names (checkpoints, optimizer state) are those of the whole model.

Modules outside the block list are owned by where they run: those registered before the list (embeddings)
by the first stage, those registered after it (final norm, head, loss modules) by the last stage. A
parameter used on both sides (an embedding tied to the head) or held directly by a module that contains
the block list (where its use cannot be placed) is kept by the first and the last stage, and their
gradients are summed. Every other rank replaces a parameter it does not own by a zero tensor expanded to
the same shape: no memory, and the parts of the user's code that run before the blocks still produce
tensors of the right shape (they are discarded when the received activation is injected).
"""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from lightning_4d.pipeline.config import PipelineConfig


_already_split: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _describe(container: nn.Module) -> str:
    kinds = Counter(type(child).__name__ for child in container)
    return f"{type(container).__name__} of " + ", ".join(f"{n} x {k}" for k, n in kinds.items())


def _block_lists(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0]


def _all_lists_text(module: nn.Module) -> str:
    lists = [f"{name} ({_describe(m)})" for name, m in _block_lists(module)]
    return "module lists found: " + ("; ".join(lists) if lists else "none")


def find_blocks(module: nn.Module, path: Optional[str]) -> tuple[str, nn.Module]:
    """The block list named by ``path``, else the longest list of two or more blocks of one type that is
    not itself inside such a list (mixture-of-experts lists inside each block are not the pipeline)."""
    if path is not None:
        try:
            container = module.get_submodule(path)
        except AttributeError:
            raise ValueError(f"pp_blocks={path!r} names no submodule of {type(module).__name__}; "
                             f"{_all_lists_text(module)}.") from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"pp_blocks={path!r} is a {type(container).__name__}, not an nn.ModuleList or"
                             f" nn.Sequential of blocks; {_all_lists_text(module)}.")
        return path, container
    candidates: list[tuple[str, nn.Module]] = []
    for name, m in _block_lists(module):
        if len(m) >= 2 and len({type(child) for child in m}) == 1 \
                and not any(name.startswith(outer + ".") for outer, _ in candidates):
            candidates.append((name, m))
    if not candidates:
        raise ValueError(
            f"Pipeline parallelism found no list of repeated blocks in {type(module).__name__} (an nn.ModuleList"
            f" or nn.Sequential of two or more modules of one type); {_all_lists_text(module)}. Name the list"
            " to split with FourDStrategy(pp_blocks='model.layers') (YAML: pp_blocks: model.layers).")
    longest = max(len(m) for _, m in candidates)
    best = [(name, m) for name, m in candidates if len(m) == longest]
    if len(best) > 1:
        raise ValueError(f"Pipeline parallelism found several block lists of length {longest}:"
                         f" {', '.join(name for name, _ in best)}. Name the one to split with pp_blocks (YAML:"
                         f" pp_blocks: {best[0][0]}).")
    return best[0]


def check_blocks(container: nn.Module, path: str, config: PipelineConfig) -> None:
    """Refuse a block list the layout cannot split: fewer blocks than stages, split points past the end, or
    one block object repeated (a stage cannot hold part of a shared block)."""
    n = len(container)
    if config.num_stages > n:
        per_rank = f" ({config.stages_per_rank} stages per rank)" if config.stages_per_rank > 1 else ""
        fewer = " or a schedule with one stage per rank (gpipe, 1f1b)" if config.stages_per_rank > 1 else ""
        raise ValueError(f"pp={config.pp} with pp_schedule={config.schedule!r} needs {config.num_stages} stages"
                         f"{per_rank}, but {path} has only {n} blocks. Use pp <= {n // config.stages_per_rank}{fewer}.")
    if config.split_points is not None and config.split_points[-1] >= n:
        raise ValueError(f"pp_split_points={list(config.split_points)} must all be below the number of blocks in"
                         f" {path} ({n}): every stage needs at least one block.")
    if len({id(block) for block in container}) < n:
        raise ValueError(f"{path} holds the same block more than once (shared weights across depth); pipeline"
                         " stages cannot share a block.")


@dataclass
class StageSplit:
    """What one rank holds after the split.

    Parameters outside the blocks are recorded by owning module and name, not as objects: tensor parallelism
    replaces parameter objects after the split, and the split must always name the live ones.
    """

    path: str
    container: nn.Module
    last: int  # index of the pipeline's last stage
    chunks: dict[int, "OrderedDict[str, nn.Module]"]  # local stage -> its blocks, by original name
    # "prefix" (first stage), "suffix" (last stage), "ends" (both): the parameters this rank keeps
    kept: dict[str, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    has_ends: bool = False  # whether the model has "ends" weights at all (the same answer on every rank)
    # (name, module, "prefix" | "suffix") of modules whose parameters are stubbed here: if the code runs one
    # on the wrong side of the blocks it would compute with zeros, so the runner checks where they run.
    stubbed: list[tuple[str, nn.Module, str]] = field(default_factory=list)

    def rest(self) -> None:
        """Between steps the list holds all local blocks (for state dicts, ``.train()``, ``.to()``)."""
        self.container._modules = OrderedDict(kv for chunk in self.chunks.values() for kv in chunk.items())

    def enter(self, stage: int) -> None:
        self.container._modules = self.chunks[stage]

    def params_of(self, stage: int) -> list[nn.Parameter]:
        """Every parameter the computation of ``stage`` uses."""
        found = [p for block in self.chunks[stage].values() for p in block.parameters()]
        roles = (["prefix", "ends"] if stage == 0 else []) + (["suffix", "ends"] if stage == self.last else [])
        found += [m._parameters[name] for role in roles for m, name in self.kept[role]]
        return list({id(p): p for p in found}.values())

    def ends(self) -> list[nn.Parameter]:
        """The live parameters this rank keeps for both the first and the last stage."""
        return list({id(p): p for p in (m._parameters[name] for m, name in self.kept["ends"])}.values())


def check_splittable(module: nn.Module, config: PipelineConfig) -> tuple[str, nn.Module]:
    """Refuse a module ``config`` cannot cut (already cut, no block list, a list that does not fit the layout);
    returns the block list's path and the list. Pure, so it fails alike on every rank."""
    if module in _already_split:
        raise ValueError(f"This {type(module).__name__} was already cut into pipeline stages by another"
                         " FourDStrategy; a stage cannot be split again. Use the same Trainer for fit, validate,"
                         " test and predict, or a freshly built module.")
    path, container = find_blocks(module, config.blocks)
    check_blocks(container, path, config)
    return path, container


def split_module(module: nn.Module, config: PipelineConfig, local_stages: list[int],
                 device: torch.device) -> StageSplit:
    """Cut ``module`` in place down to ``local_stages`` (see the module docstring); no communication."""
    path, container = check_splittable(module, config)
    names = list(container._modules)
    bounds = config.stage_bounds(len(names))
    chunks = {s: OrderedDict((names[i], container._modules[names[i]]) for i in range(*bounds[s]))
              for s in local_stages}
    last_stage = config.num_stages - 1
    first, last = 0 in local_stages, last_stage in local_stages

    roles: dict[int, set[str]] = {}
    places: dict[int, tuple[nn.Parameter, list[tuple[str, nn.Module, str]]]] = {}
    after = False
    for name, m in module.named_modules():
        if name == path:
            after = True
            continue
        if name.startswith(path + "."):
            continue
        role = "ends" if name == "" or path.startswith(name + ".") else ("suffix" if after else "prefix")
        for pname, p in m._parameters.items():
            if p is not None:
                roles.setdefault(id(p), set()).add(role)
                places.setdefault(id(p), (p, []))[1].append((name, m, pname))

    def role_of(pid: int) -> str:
        found = roles[pid]
        return next(iter(found)) if len(found) == 1 else "ends"

    kept: dict[str, list[tuple[nn.Module, str]]] = {"prefix": [], "suffix": [], "ends": []}
    stubbed: dict[int, tuple[str, nn.Module, str]] = {}
    for pid, (p, where) in places.items():
        role = role_of(pid)
        if (role == "prefix" and first) or (role == "suffix" and last) or (role == "ends" and (first or last)):
            kept[role] += [(m, pname) for _, m, pname in where]
            continue
        stub = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
        for name, m, pname in where:
            del m._parameters[pname]
            m.register_buffer(pname, stub, persistent=False)
            if role != "ends":
                stubbed[id(m)] = (name, m, role)

    has_ends = any(role_of(pid) == "ends" for pid in places)
    split = StageSplit(path, container, last_stage, chunks, kept, has_ends, list(stubbed.values()))
    split.rest()
    _already_split.add(module)
    return split
