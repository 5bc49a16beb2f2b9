"""Which modules each step of the composition acts on, decided from the pipeline's and tensor parallelism's facts:
the blocks this rank holds (activation checkpointing, compile, FSDP's block units), the modules around them that
become FSDP units of their own, and the parameters kept out of FSDP. Read by :mod:`lightning_4d.composition.parallelize` only."""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_4d.pipeline import PipelineConfig, PipelinePlan, find_blocks
from lightning_4d.tensor_parallel import TensorParallelPlan


def held_blocks(module: nn.Module, plan: Optional[PipelinePlan], config: PipelineConfig,
                 feature: str = "activation_checkpointing") -> list[tuple[int, nn.Module]]:
    """The blocks this rank holds, with their position in the whole model's block list. ``feature``: the
    option that needs them, named in the error (with the value that turns it off) when there are none."""
    if plan is not None:
        container = module.get_submodule(plan.path)
        return [(plan.blocks.index(name), block) for name, block in container.named_children()]
    try:
        _, container = find_blocks(module, config.blocks)
    except ValueError as error:
        off = {"activation_checkpointing": "'none'", "compile": "False"}[feature]
        raise ValueError(f"{feature} works on the module's blocks, but {error} Or use {feature}={off}.") from None
    return list(enumerate(container.children()))


def blocks_to_compile(module: nn.Module, plan: Optional[PipelinePlan], config: PipelineConfig) -> list[nn.Module]:
    """The blocks ``compile=True`` compiles: those this rank holds."""
    return [block for _, block in held_blocks(module, plan, config, "compile")]


def fsdp_blocks(module: nn.Module, plan: Optional[PipelinePlan], config: PipelineConfig) -> list[nn.Module]:
    """The blocks FSDP makes one unit each; none (the module is one unit) if it has no block list."""
    try:
        return [block for _, block in held_blocks(module, plan, config)]
    except ValueError:
        return []


def units_around_blocks(module: nn.Module, path: str,
                         ends: list[nn.Parameter]) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """Under pipelining: the modules around the block list at ``path`` that become FSDP units of their own (each
    child of a module above the blocks that holds parameters), and the parameters that stay replicated: those
    held directly by a module above the blocks, those two units would share, and ``ends`` (weights kept by the
    first and the last stage, whose gradients the pipeline sums over both)."""
    above = [module]
    for name in path.split(".")[:-1]:
        above.append(getattr(above[-1], name))
    on_path = {id(m) for m in above} | {id(module.get_submodule(path))}
    kept = [p for m in above for p in m.parameters(recurse=False)]
    candidates = [child for m in above for child in m.children()
                  if id(child) not in on_path and any(True for _ in child.parameters())]
    owners: dict[int, int] = {}
    for child in candidates:
        for p in child.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    ends_ids = {id(p) for p in ends}
    kept += [p for child in candidates for p in child.parameters() if owners[id(p)] > 1 or id(p) in ends_ids]
    kept = list({id(p): p for p in kept}.values())
    kept_ids = {id(p) for p in kept}
    units = [child for child in candidates if any(id(p) not in kept_ids for p in child.parameters())]
    return units, kept


def modules_around_blocks(module: nn.Module, config: PipelineConfig) -> list[nn.Module]:
    """``shard_units="modules"``: the modules around the block list that become FSDP units of their own, those
    of :func:`units_around_blocks` that hold no parameter another module holds too (a tied embedding and head
    stay in the root unit, which gathers them once for both)."""
    try:
        path, _ = find_blocks(module, config.blocks)
    except ValueError:
        return []
    units, kept = units_around_blocks(module, path, [])
    kept_ids = {id(p) for p in kept}
    return [unit for unit in units if all(id(p) not in kept_ids for p in unit.parameters())]


def shared_params(module: nn.Module) -> frozenset[int]:
    """Ids of the parameters registered in more than one place."""
    seen: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return frozenset(key for key, count in seen.items() if count > 1)


def gradient_hooked(module: nn.Module, plan: Optional[TensorParallelPlan]) -> list[nn.Parameter]:
    """Parameters whose gradients tensor parallelism sums over tp with a hook on the parameter (per-head norms,
    key/value projections kept whole when there are fewer key/value heads than tp ranks, or the fused
    projection holding such k and v rows):
    FSDP would replace the parameter and lose the hook, so they stay out of FSDP, replicated, and the gradient
    buckets average them over ``dp x cp``."""
    if plan is None:
        return []
    return [param for fqn, region in plan.regions.items()
            for name in region.tp_summed
            for param in module.get_submodule(fqn).get_submodule(name).parameters()]
