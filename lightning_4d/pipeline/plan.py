"""Where pipeline parallelism cuts a module: decided once, without communication, and printed at start-up.

The cut is at the module's list of repeated blocks (:func:`find_blocks`): stage ``s`` runs blocks
``bounds[s]`` of it. Modules outside the list are owned by where they run: those used before the list
(embeddings) by the first stage, those used after it (final norm, head, loss modules) by the last stage, in
the order the forward of the module holding both uses them (registration order where it does not name
them). A parameter used on both sides (an embedding tied to the head), or held directly by a module that
contains the block list (where its use cannot be placed), is kept by the first and the last stage, which sum
its gradients. The plan answers, for any pipeline rank, which modules it holds: tensor parallelism shards only
those, the split stubs the rest, and checkpoints know every key of the whole model.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

from torch import nn

from lightning_4d import _compat as compat
from lightning_4d.pipeline.config import PipelineConfig

# Containers a block list can be: the module's own code iterates them (``for layer in self.layers``,
# ``self.layers.values()``), so holding only a stage's blocks in them runs only that stage.
BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
ROLES = ("prefix", "suffix", "ends")  # kept by the first stage, the last stage, both


def _blocks_in(container: nn.Module) -> list[nn.Module]:
    """The container's blocks in order, repeats included (``children()`` would drop a repeated block)."""
    return list(compat.children_of(container).values())


def _describe_list(container: nn.Module) -> str:
    kinds = Counter(type(child).__name__ for child in _blocks_in(container))
    return f"{type(container).__name__} of " + ", ".join(f"{n} x {k}" for k, n in kinds.items())


def _block_lists(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, BLOCK_CONTAINERS) and len(m) > 0]


def _all_lists_text(module: nn.Module) -> str:
    """The module's lists, those inside an item of another list (a block's adapters or experts) left out."""
    found = _block_lists(module)
    lists = [f"{name} ({_describe_list(m)})" for name, m in found if not _inside_items(name, found)]
    return "module lists found: " + ("; ".join(lists) if lists else "none")


def _inside_items(name: str, lists: list[tuple[str, nn.Module]]) -> bool:
    """Whether ``name`` lies inside an item of one of ``lists`` (below ``outer.<item>.``, not an item itself):
    an adapter, expert or sub-layer list inside a block belongs to that block, whatever the outer list holds."""
    return any(name.startswith(outer + ".") and "." in name[len(outer) + 1:] for outer, _ in lists)


def find_blocks(module: nn.Module, path: Optional[str],
                config: Optional[PipelineConfig] = None) -> tuple[str, nn.Module]:
    """The block list named by ``path``, else the longest list of two or more blocks of one type that is not
    inside an item of another list (mixture-of-experts lists, Zamba2's adapter lists inside each block are not
    the pipeline), blocks of modules preferred over lists of single layers. Parallel lists of one layer's parts
    (XLM's) are refused. ``config`` (the layout) lets a refusal check the list it proposes."""
    if path is not None:
        try:
            container = module.get_submodule(path)
        except AttributeError:
            raise ValueError(f"pp_blocks={path!r} names no submodule of {type(module).__name__}; "
                             f"{_all_lists_text(module)}.") from None
        if not isinstance(container, BLOCK_CONTAINERS):
            raise ValueError(f"pp_blocks={path!r} is a {type(container).__name__}, not an nn.ModuleList,"
                             f" nn.Sequential or nn.ModuleDict of blocks; {_all_lists_text(module)}.")
        return path, container
    lists = _block_lists(module)
    outermost = [(name, m) for name, m in lists if len(m) >= 2 and not _inside_items(name, lists)]
    candidates = [(name, m) for name, m in outermost if len({type(child) for child in _blocks_in(m)}) == 1]
    if not candidates:
        raise ValueError(
            f"Pipeline parallelism found no list of repeated blocks in {type(module).__name__} (an nn.ModuleList,"
            f" nn.Sequential or nn.ModuleDict of two or more modules of one type); {_all_lists_text(module)}."
            f" {_mixed_list_fix(module, outermost, config)}")
    layered = [(name, m) for name, m in candidates if any(next(b.children(), None) for b in _blocks_in(m))]
    candidates = layered or candidates  # blocks of modules over lists of single layers (MusicGen's codebook heads)
    longest = max(len(m) for _, m in candidates)
    best = [(name, m) for name, m in candidates if len(m) == longest]
    parents = Counter(name.rpartition(".")[0] for name, _ in best)
    parent, count = parents.most_common(1)[0]
    if count > 1:
        parallel = [name.rpartition(".")[2] for name, _ in best if name.rpartition(".")[0] == parent]
        raise ValueError(
            f"Pipeline parallelism found the layers of {parent or type(module).__name__} held as parallel lists of"
            f" {longest} ({', '.join(parallel)}; the i-th layer's parts one in each, as XLM keeps them): a cut at"
            " one list would leave the others whole and its code indexes them all by layer, so no pp_blocks can cut"
            " it. Use pp=1 (dp=N replicates the model instead).")
    if len(best) > 1:
        raise ValueError(f"Pipeline parallelism found several block lists of length {longest}:"
                         f" {', '.join(name for name, _ in best)}. Name the one to split with pp_blocks (YAML:"
                         f" pp_blocks: {best[0][0]}).")
    return best[0]


def _mixed_list_fix(module: nn.Module, lists: list[tuple[str, nn.Module]], config: Optional[PipelineConfig]) -> str:
    """The fix for a module without a list of one block type: the longest list of mixed modules that the layout
    can cut (checked when ``config`` is given), else why none can, and pp=1."""
    if not lists:
        return ("None holds two or more blocks: if the module runs blocks one after another, hold them in an"
                " nn.ModuleList and name that list with pp_blocks; a model that runs one block again and again (its"
                " weights shared across depth, as ALBERT) cannot be cut: use pp=1 (dp=N replicates the model instead).")
    name, _ = max(lists, key=lambda item: len(item[1]))
    if config is not None:
        try:
            PipelinePlan.build(module, replace(config, blocks=name))
        except ValueError as error:  # each of the plan's refusals names its own fix
            return f"Its longest list, {name}, cannot be cut either: {error}"
    return (f"If the modules of {name} run one after another on one activation, name it: FourDStrategy("
            f"pp_blocks={name!r}) (YAML: pp_blocks: {name}).")


def _side(module: nn.Module, path: str, name: str, registered_after: bool) -> str:
    """``"suffix"`` if module ``name`` runs after the block list, else ``"prefix"``. The order is read from the
    forward of the deepest module holding both: which of the two it touches first (OPT's decoder registers
    ``final_layer_norm`` before ``layers`` and runs it after them; litgpt's GPT registers ``lm_head`` before
    ``transformer``). Where that forward does not name both, registration order decides."""
    mine, blocks = name.split("."), path.split(".")
    depth = next(i for i, (a, b) in enumerate(zip(mine, blocks)) if a != b)
    order = _attribute_order(type(module.get_submodule(".".join(mine[:depth]))))
    if mine[depth] in order and blocks[depth] in order:
        return "suffix" if order[mine[depth]] > order[blocks[depth]] else "prefix"
    return "suffix" if registered_after else "prefix"


@functools.lru_cache(maxsize=None)
def _attribute_order(cls: type) -> dict[str, int]:
    """The order in which ``cls.forward`` first uses each ``self.<attribute>``, as it runs: statements in turn,
    a call's arguments before the call (``self.head(self.body(self.embed(x)))`` uses embed, body, head)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return {}
    order = _UseOrder()
    order.visit(tree)
    return order.first


class _UseOrder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.first: dict[str, int] = {}

    def visit_Call(self, node: ast.Call) -> None:
        for argument in (*node.args, *node.keywords):
            self.visit(argument)
        self.visit(node.func)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            self.first.setdefault(node.attr, len(self.first))


def _check_not_encoder_decoder(module: nn.Module, pp: int) -> None:
    """Refuse an encoder-decoder (``nn.Transformer``, ``nn.TransformerDecoder``, a Hugging Face model with
    ``config.is_encoder_decoder``): its decoder reads the encoder's output (``memory``) and the embedded target
    beside the activation that one stage passes to the next, so the stages after the first would compute them
    from modules they do not hold and train a different model without an error."""
    for fqn, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if isinstance(sub, (nn.Transformer, nn.TransformerDecoder)) or getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"pp={pp}: {fqn or 'the module'} ({type(sub).__name__}) is an encoder-decoder: its decoder reads the"
                " encoder's output (memory) and its own embedded input beside the one activation that pipeline"
                " stages pass on, so a later stage would compute them from modules it does not hold. Whichever"
                " block list pp_blocks names, the cut cannot carry them. Use pp=1 (dp=N replicates the model"
                " instead).")


def _check_no_reentrant_checkpoint(blocks: Sequence[object], path: str, pp: int) -> None:
    """Refuse blocks that checkpoint themselves reentrantly around their ``__call__`` (Hugging Face's
    ``gradient_checkpointing_enable`` with ``use_reentrant=True``): the stage's first block then runs under
    ``torch.no_grad`` with the received activation swapped in by a hook inside the checkpoint, which takes
    gradients for its own inputs only, so the previous stage would get none and train wrong without an error."""
    for index, block in enumerate(blocks):
        if isinstance(block, nn.Module) and compat.hf_reentrant_checkpointing(block):
            raise ValueError(
                f"pp={pp}: {path}.{index} ({type(block).__name__}) checkpoints itself with use_reentrant=True: a"
                " reentrant checkpoint computes gradients for its own inputs only, so the activation a pipeline"
                " stage receives would get none. Use gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}) (Hugging Face's default), or FourDStrategy(activation_checkpointing="
                "'full') in its place.")


def _check_no_weight_across_stages(blocks: Sequence[nn.Module], names: Sequence[str], path: str,
                                   config: PipelineConfig) -> None:
    """Refuse blocks on different stages that hold one module or parameter (Zamba's and Zamba2's shared
    transformer, called by every hybrid layer): each stage would hold and update its own copy, and the model
    would train as several models without an error."""
    seen: dict[int, tuple[int, str]] = {}
    for stage, (start, stop) in enumerate(config.stage_bounds(len(blocks))):
        for index in range(start, stop):
            block = f"{path}.{names[index]}"
            items = [*_block_modules(blocks[index]), *blocks[index].named_parameters(remove_duplicate=False)]
            for name, item in items:
                first_stage, first = seen.setdefault(id(item), (stage, f"{block}.{name}".rstrip(".")))
                if first_stage != stage:
                    kind = type(item).__name__ if isinstance(item, nn.Module) else f"parameter {tuple(item.shape)}"
                    raise ValueError(
                        f"pp={config.pp}: {first} and {block}.{name} are one {kind} (shared or tied between blocks"
                        f" of {path}), and stages {first_stage} and {stage} hold those blocks: pipeline stages cannot"
                        " share a weight, each would train its own copy. Use pp=1 (dp=N replicates the model"
                        " instead).")


def _block_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """A block's submodules holding parameters, itself excluded, shallowest first, a module reached twice listed
    twice (a module of buffers alone, a shared rotary table, trains nothing: each stage may hold a copy)."""
    return [(name, m) for name, m in block.named_modules(remove_duplicate=False)
            if name and next(m.parameters(), None) is not None]


def check_blocks(blocks: Sequence[object], path: str, config: PipelineConfig) -> None:
    """Refuse a block list the layout cannot split: fewer blocks than stages, split points past the end, or
    one block object repeated (a stage cannot hold part of a shared block)."""
    n = len(blocks)
    if config.num_stages > n:
        per_rank = f" ({config.stages_per_rank} stages per rank)" if config.stages_per_rank > 1 else ""
        fewer = " or a schedule with one stage per rank (gpipe, 1f1b)" if config.stages_per_rank > 1 else ""
        raise ValueError(f"pp={config.pp} with pp_schedule={config.schedule!r} needs {config.num_stages} stages"
                         f"{per_rank}, but {path} has only {n} blocks. Use pp <= {n // config.stages_per_rank}{fewer}.")
    if config.split_points is not None and config.split_points[-1] >= n:
        raise ValueError(f"pp_split_points={list(config.split_points)} must all be below the number of blocks in"
                         f" {path} ({n}): every stage needs at least one block.")
    if len({id(block) for block in blocks}) < n:
        raise ValueError(f"{path} holds the same block more than once (shared weights across depth); pipeline"
                         " stages cannot share a block.")


@dataclass(frozen=True)
class PipelinePlan:
    """Which modules every stage holds, and where every stage runs; the same on every rank."""

    config: PipelineConfig
    path: str  # the block list
    blocks: tuple[str, ...]  # its children's names, in order
    bounds: tuple[tuple[int, int], ...]  # the [start, stop) block range of every stage
    stage_ranks: tuple[int, ...]  # the pipeline rank of every stage
    # Parameters outside the blocks: every place one is registered ("module.fqn", "name") and its role.
    outside: tuple[tuple[tuple[tuple[str, str], ...], str], ...]
    modules: tuple[str, ...]  # every module FQN of the whole model
    state_keys: frozenset[str]  # every state-dict key of the whole model

    @classmethod
    def build(cls, module: nn.Module, config: PipelineConfig) -> PipelinePlan:
        """Plan the cut; raises a ValueError naming the fix if ``module`` cannot be cut this way."""
        _check_not_encoder_decoder(module, config.pp)
        path, container = find_blocks(module, config.blocks, config)
        check_blocks(_blocks_in(container), path, config)
        _check_no_weight_across_stages(_blocks_in(container), list(compat.children_of(container)), path, config)
        _check_no_reentrant_checkpoint(_blocks_in(container), path, config.pp)
        roles: dict[int, set[str]] = {}
        places: dict[int, list[tuple[str, str]]] = {}
        after = False
        for name, m in module.named_modules():
            if name == path:
                after = True
                continue
            if name.startswith(path + "."):
                continue
            role = "ends" if name == "" or path.startswith(name + ".") else _side(module, path, name, after)
            for pname, p in m.named_parameters(recurse=False):
                roles.setdefault(id(p), set()).add(role)
                places.setdefault(id(p), []).append((name, pname))
        outside = tuple((tuple(where), next(iter(roles[pid])) if len(roles[pid]) == 1 else "ends")
                        for pid, where in places.items())
        blocks = tuple(name for name, _ in container.named_children())
        return cls(config, path, blocks, tuple(config.stage_bounds(len(blocks))), tuple(config.stage_ranks()),
                   outside, tuple(name for name, _ in module.named_modules()), frozenset(module.state_dict()))

    @property
    def last(self) -> int:
        return len(self.bounds) - 1

    @property
    def has_ends(self) -> bool:
        """Whether a weight is kept by the first and the last stage (then their gradients are summed)."""
        return any(role == "ends" for _, role in self.outside)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [stage for stage, rank in enumerate(self.stage_ranks) if rank == pp_rank]

    def stage_blocks(self, stage: int) -> tuple[str, ...]:
        return self.blocks[slice(*self.bounds[stage])]

    def keeps(self, role: str, stages: list[int]) -> bool:
        first, last = 0 in stages, self.last in stages
        return (role == "prefix" and first) or (role == "suffix" and last) or (role == "ends" and (first or last))

    def held_modules(self, pp_rank: int) -> set[str]:
        """The largest modules ``pp_rank`` holds whole: the blocks of its stages, and every module outside the
        block list whose parameters it keeps, all of them (so never a container of the block list)."""
        stages = self.stages_of(pp_rank)
        held = {f"{self.path}.{name}" for s in stages for name in self.stage_blocks(s)}
        whole: dict[str, bool] = {}
        for where, role in self.outside:
            for fqn, _ in where:
                parts = fqn.split(".") if fqn else []
                for end in range(1, len(parts) + 1):
                    owner = ".".join(parts[:end])
                    if not (self.path == owner or self.path.startswith(owner + ".")):
                        whole[owner] = whole.get(owner, True) and self.keeps(role, stages)
        return held | {fqn for fqn, kept in whole.items() if kept}

    def describe(self) -> str:
        """The plan as printed at start-up: each stage's rank and modules, and the weights tied across stages."""
        c = self.config
        lines = [f"pipeline plan: pp={c.pp}, schedule {c.schedule}, {c.num_microbatches} micro-batches,"
                 f" {len(self.bounds)} stages, blocks {self.path} ({len(self.blocks)})"]
        order = {fqn: index for index, fqn in enumerate(self.modules)}
        owners = {role: {fqn for where, r in self.outside if r == role for fqn, _ in where} for role in ROLES}
        for stage, rank in enumerate(self.stage_ranks):
            start, stop = self.bounds[stage]
            held = {fqn: fqn or "(root)" for fqn in owners["ends"] | owners["prefix" if stage == 0 else "ends"]
                    | owners["suffix" if stage == self.last else "ends"]}
            held[self.path] = f"{self.path}.{self.blocks[start]}" + (f"-{self.blocks[stop - 1]}" if stop - start > 1
                                                                     else "")
            listed = ", ".join(held[fqn] for fqn in sorted(held, key=order.__getitem__))
            lines.append(f"  stage {stage} (pp rank {rank}): {listed}")
        tied = [" = ".join(f"{fqn}.{name}" if fqn else name for fqn, name in where)
                for where, role in self.outside if role == "ends"]
        if tied:
            lines.append("  kept by the first and the last stage, gradients summed: " + "; ".join(tied))
        return "\n".join(lines)
