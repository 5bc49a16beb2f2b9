"""Cutting an unchanged module down to this rank's pipeline stages, as its :class:`PipelinePlan` says.

The block list stays where it is, holding only this rank's blocks under their original names, so that the
module's own ``for layer in self.layers`` loop runs exactly the blocks of the stage being executed, and
parameter names (checkpoints, optimizer state) are those of the whole model.

Every rank replaces a parameter outside the blocks that it does not keep by a zero tensor expanded to the
same shape: no memory, and the parts of the user's code that run before the blocks still produce tensors of
the right shape (they are discarded when the received activation is injected).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_4d import _compat as compat
from lightning_4d.pipeline.plan import PipelinePlan


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
    # (name, module, "prefix" | "suffix") of modules whose parameters are stubbed here: if the code runs one
    # on the wrong side of the blocks it would compute with zeros, so the runner checks where they run.
    stubbed: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    # Per-layer lists of a configuration (Hugging Face's ``config.layer_types``), one entry per block of the whole
    # list: (configuration, attribute, the whole list, each block's name -> its position in it).
    per_layer: list[tuple[object, str, list, dict[str, int]]] = field(default_factory=list)

    def rest(self) -> None:
        """Between steps the list holds all local blocks (for state dicts, ``.train()``, ``.to()``)."""
        compat.set_children(self.container, OrderedDict(kv for chunk in self.chunks.values() for kv in chunk.items()))
        for config, name, whole, _ in self.per_layer:
            setattr(config, name, whole)

    def enter(self, stage: int) -> None:
        """While ``stage`` runs the list holds its blocks only. A ModuleList or Sequential numbers them from 0,
        as the stage's own list would, so that code indexing the list (``self.layers[0]`` in
        ``nn.TransformerEncoder``, ``for i in range(len(self.layers))``) finds them; a ModuleDict keeps its keys."""
        chunk = self.chunks[stage]
        for config, name, whole, positions in self.per_layer:
            # The stage's i-th block's entry at i (code reading config.layer_types[i] for the i-th block it runs),
            # the whole list's length and other entries kept (a cache sized by it, indexed by each block's
            # layer_idx: the stages after the first start past their own blocks' count).
            local = list(whole)
            for index, block in enumerate(chunk):
                local[index] = whole[positions[block]]
            setattr(config, name, local)
        if not isinstance(self.container, nn.ModuleDict):
            chunk = OrderedDict((str(index), block) for index, block in enumerate(chunk.values()))
        compat.set_children(self.container, chunk)

    def params_of(self, stage: int) -> list[nn.Parameter]:
        """Every parameter the computation of ``stage`` uses."""
        found = [p for block in self.chunks[stage].values() for p in block.parameters()]
        roles = (["prefix", "ends"] if stage == 0 else []) + (["suffix", "ends"] if stage == self.last else [])
        found += [compat.parameters_of(m)[name] for role in roles for m, name in self.kept[role]]
        return list({id(p): p for p in found}.values())

    def ends(self) -> list[nn.Parameter]:
        """The live parameters this rank keeps for both the first and the last stage."""
        return list({id(p): p for p in (compat.parameters_of(m)[name] for m, name in self.kept["ends"])}.values())


def split_module(module: nn.Module, plan: PipelinePlan, local_stages: list[int], device: torch.device) -> StageSplit:
    """Cut ``module`` in place down to ``local_stages``; no communication."""
    container = module.get_submodule(plan.path)
    blocks = compat.children_of(container)
    chunks = {s: OrderedDict((name, blocks[name]) for name in plan.stage_blocks(s)) for s in local_stages}
    kept: dict[str, list[tuple[nn.Module, str]]] = {"prefix": [], "suffix": [], "ends": []}
    stubbed: dict[int, tuple[str, nn.Module, str]] = {}
    for where, role in plan.outside:
        owners = [(fqn, module.get_submodule(fqn), name) for fqn, name in where]
        if plan.keeps(role, local_stages):
            kept[role] += [(m, name) for _, m, name in owners]
            continue
        p = compat.parameters_of(owners[0][1])[owners[0][2]]
        stub = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
        for fqn, m, name in owners:
            del compat.parameters_of(m)[name]
            m.register_buffer(name, stub, persistent=False)
            if role != "ends":
                stubbed[id(m)] = (fqn, m, role)
    split = StageSplit(plan.path, container, plan.last, chunks, kept, list(stubbed.values()),
                       _per_layer_lists(module, plan.path, list(blocks)))
    split.rest()
    return split


def _per_layer_lists(module: nn.Module, path: str, blocks: list[str]) -> list[tuple[object, str, list, dict]]:
    """The per-layer lists (an attribute naming layers, as long as the block list) of the configurations held
    by the modules above the block list: a stage's code indexes them by its blocks' local numbers (transformers
    5.24's Gemma 3 reads ``config.layer_types[i]`` for the i-th block it runs, which 5.3 read from the block)."""
    parts = path.split(".")
    configs = {id(c): c for c in (getattr(module.get_submodule(".".join(parts[:n])), "config", None)
                                  for n in range(len(parts))) if c is not None}
    positions = {name: index for index, name in enumerate(blocks)}
    return [(config, name, value, positions) for config in configs.values()
            for name, value in list(getattr(config, "__dict__", {}).items())
            if "layer" in name and isinstance(value, list) and len(value) == len(blocks)]
