"""What tensor parallelism will do to a module, decided without communication: the plan's types.

``TensorParallelPlan`` lists per module FQN the sharding style (``ModuleStyle``), the attention and MLP
regions (``Region``), the size attributes to divide by tp, and what stays replicated. It is made by
:func:`~lightning_4d.tensor_parallel.discovery.plan_tensor_parallel` and carried out by
:func:`~lightning_4d.tensor_parallel.apply.apply_tensor_parallel`. The small helpers at the end are the
vocabulary the other modules of the package share (module shapes, FQN patterns).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from lightning.fabric.utilities import rank_zero_warn

from lightning_4d import _compat as compat
from lightning_4d.tensor_parallel.adapters import base_layer, describe_factors

STYLES = ("colwise", "rowwise", "sequence_parallel", "sharded_norm", "replicate")
# Styles whose module holds a 1/tp share of its parameters (the plan's sharded share counts them).
SHARDED_STYLES = ("colwise", "rowwise", "sharded_norm", "experts")  # experts: tensor_parallel/experts.py
_SEQUENCE_DIM = 1


class _FusedRows(ABC):
    """A projection whose output features are segments side by side (q|k|v, gate|up), which the module's code
    splits by width. A column-wise shard of the live weight is contiguous, so the rows are permuted once to
    give every rank its part of each segment, in the segments' order; checkpoints keep the original order.

    A segment cut into fewer pieces than ranks (the key/value heads when they are fewer than tp) gives each
    rank one whole piece, the same piece to ``tp // pieces`` ranks: the live weight then holds those rows more
    than once, and checkpoints keep one copy of them."""

    dim: int  # output-feature dim of the weight: 0 for nn.Linear, 1 for Conv1D

    @abstractmethod
    def widths(self) -> list[int]:
        """The segments' widths, in the order of the original rows."""

    def pieces(self, tp: int) -> list[int]:
        """How many pieces each segment is cut into over ``tp`` ranks (rank r holds piece ``r * pieces // tp``)."""
        return [tp] * len(self.widths())

    def permutation(self, tp: int) -> torch.Tensor:
        """Index of the original rows that puts rank r's piece of every segment next to each other in its
        contiguous shard (an original row appears once per rank that holds it)."""
        segments = torch.arange(sum(self.widths())).split(self.widths())
        return torch.cat([seg.chunk(n)[r * n // tp] for r in range(tp) for seg, n in zip(segments, self.pieces(tp))])

    def repeated(self, tp: int) -> list[tuple[int, int, int]]:
        """(start, length, pieces) in a rank's shard of each segment held alike by several ranks."""
        found, start = [], 0
        for width, n in zip(self.widths(), self.pieces(tp)):
            if n < tp:
                found.append((start, width // n, n))
            start += width // n
        return found

    def moves(self, tp: int) -> bool:
        """Whether the live rows differ from the original ones (else nothing is permuted or hooked)."""
        return True

    def to_tp(self, tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
        return tensor.index_select(dim, self.permutation(tp).to(tensor.device))

    def to_original(self, tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
        """The original rows of a live (permuted) tensor; a row held more than once is read from its first copy."""
        permutation = self.permutation(tp)
        order = torch.argsort(permutation, stable=True)
        first = torch.ones_like(order, dtype=torch.bool)
        first[1:] = permutation[order[1:]] != permutation[order[:-1]]
        return tensor.index_select(dim, order[first].to(tensor.device))


@dataclass(frozen=True)
class FusedQKVLayout(_FusedRows):
    """Rows of a fused attention projection: ``q_heads`` then ``kv_heads`` then ``kv_heads`` heads of
    ``head_dim`` (GPT-2's ``c_attn``, litgpt's ``qkv``, Phi-3's ``qkv_proj``, GPTBigCode's multi-query
    ``c_attn``). With fewer key/value heads than ranks, each rank holds whole the one key/value head its query
    heads read (GPTBigCode's one: k and v whole on every rank)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dim: int

    def widths(self) -> list[int]:
        return [self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]

    def pieces(self, tp: int) -> list[int]:
        return [tp, min(self.kv_heads, tp), min(self.kv_heads, tp)]


@dataclass(frozen=True)
class GroupedQKVLayout(_FusedRows):
    """Rows of a fused attention projection laid out by key/value group: for each of ``kv_heads`` groups its
    ``q_per_kv`` query heads, then its k head, then its v head, ``head_dim`` rows each (torchtitan's
    ``FusedQKVLinear.wqkv``, viewed as ``[groups, q_per_kv + 2, head_dim]``). With ``kv_heads`` divisible by
    tp a contiguous shard already holds whole groups: nothing is permuted. With fewer key/value heads than
    ranks, rank r holds its group's share of query heads and that group's k and v whole (group
    ``r * kv_heads // tp``, as ``FusedQKVLayout`` gives the ranks their key/value head)."""

    q_per_kv: int
    kv_heads: int
    head_dim: int
    dim: int

    def widths(self) -> list[int]:
        return [self.q_per_kv * self.head_dim, self.head_dim, self.head_dim] * self.kv_heads

    def permutation(self, tp: int) -> torch.Tensor:
        rows = torch.arange(sum(self.widths())).view(self.kv_heads, -1)
        if self.kv_heads % tp == 0:
            return rows.flatten()
        copies = tp // self.kv_heads  # ranks sharing one group
        q_rows = self.q_per_kv * self.head_dim
        return torch.cat([torch.cat([rows[r // copies, :q_rows].chunk(copies)[r % copies], rows[r // copies, q_rows:]])
                          for r in range(tp)])

    def repeated(self, tp: int) -> list[tuple[int, int, int]]:
        if self.kv_heads % tp == 0:
            return []
        start = self.q_per_kv * self.head_dim // (tp // self.kv_heads)
        return [(start, self.head_dim, self.kv_heads), (start + self.head_dim, self.head_dim, self.kv_heads)]

    def moves(self, tp: int) -> bool:
        return self.kv_heads % tp != 0


@dataclass(frozen=True)
class FusedGateUpLayout(_FusedRows):
    """Rows of a fused MLP input projection: gate then up, ``inner`` features each (Phi-3's ``gate_up_proj``,
    whose output the MLP halves with ``chunk(2)``)."""

    inner: int
    dim: int

    def widths(self) -> list[int]:
        return [self.inner, self.inner]


@dataclass(frozen=True)
class ModuleStyle:
    """How one module is sharded; layouts are ``"replicate"`` or ``"shard(N)"``, None for the style's default."""

    style: str
    input: str | None = None
    output: str | None = None
    role: str = "user"  # attention | mlp | embedding | head | norm | user


@dataclass
class Region:
    """An attention or MLP module whose column-wise children feed its row-wise child."""

    kind: str
    inputs: tuple[str, ...]
    output: str
    width: int
    inner: int
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    fused: _FusedRows | None = None  # the single input projection's row layout, when it is fused
    head_norms: tuple[str, ...] = ()
    # Norms over a whole separate projection's output (OLMo 2's q_norm/k_norm over num_heads * head_dim), applied
    # before the heads are split: sharded like that output ("sharded_norm"), the statistic all-reduced over tp.
    projection_norms: tuple[str, ...] = ()
    # Fewer key/value heads than tp ranks: k and v stay whole on every rank, each rank keeps the one key/value
    # head its query heads read, and their gradients are summed over tp (Megatron's way). In a fused projection
    # (``fused``) only its k and v rows are held so; its q rows are sharded.
    kv_replicated: bool = False
    # An MLP whose linears are direct children of a larger module (OPT's decoder layer holds fc1/fc2 beside its
    # attention): the region is only those linears, and the modules beside them are planned on their own.
    loose: bool = False
    # A single input projection holding q, k and v head by head (GPT-NeoX, Bloom): nothing to permute.
    interleaved: bool = False
    # Whether the attention module's own code sees the hidden state narrowed to width/tp (code that splits heads
    # by the hidden width, ``C // n_head``); not where it adds the hidden state as a residual (BERT).
    narrow: bool = True
    # Norms after the row-wise output inside the region (BERT's ``output.LayerNorm``): whole, replicated.
    after: tuple[str, ...] = ()
    # Multi-head latent attention: the low-rank down-projections and their norms, whole on every rank, and
    # (projection, first column) of the down-projection's columns every head reads (the rotary key): their
    # gradient, computed from this rank's heads only, is summed over tp.
    low_rank: tuple[str, ...] = ()
    shared_columns: tuple[str, int] | None = None
    # Embeddings of one value per head (T5's relative-position bias, [buckets, heads]): column-wise, by heads.
    head_embeddings: tuple[str, ...] = ()

    @property
    def replicated_kv_projections(self) -> tuple[str, ...]:
        return self.inputs[1:] if self.kv_replicated else ()

    @property
    def holders(self) -> list[str]:
        """The modules between the region and its projections (``qkv_linear`` of ``qkv_linear.wqkv``)."""
        names = [name.split(".") for name in (*self.inputs, self.output)]
        return sorted({".".join(parts[:i]) for parts in names for i in range(1, len(parts))}, key=len)

    @property
    def tp_summed(self) -> tuple[str, ...]:
        """The children whose parameters' gradients hooks sum over tp: per-head norms, and the k and v
        projections kept whole (or a fused projection holding k and v rows kept whole)."""
        fused = self.inputs[:1] if self.kv_replicated and self.fused is not None else ()
        return (*self.head_norms, *self.replicated_kv_projections, *fused)


# Below this share of the parameters outside the embedding and head, a plan is reported as under-sharding.
MIN_SHARDED = 0.9


@dataclass(frozen=True)
class Coverage:
    """How much of the module's body (every parameter outside the vocabulary embedding and LM head) the plan
    shards, and the largest modules it leaves whole on every tp rank."""

    sharded: int
    total: int
    replicated: tuple[tuple[str, int, int], ...] = ()  # (FQN pattern, modules, parameters), largest first

    @property
    def share(self) -> float:
        return self.sharded / self.total if self.total else 1.0

    def check(self, tp: int, strict: bool) -> None:
        """Say when the plan shards less than ``MIN_SHARDED`` of the body: a warning on rank 0, or with
        ``strict`` a ValueError (pure: the same on every rank, before any collective)."""
        if self.share >= MIN_SHARDED:
            return
        message = (f"tp={tp} shards only {self.describe()}. Every tp rank holds and computes those modules whole, so"
                   " tensor parallelism saves little memory or time on them. Fix: shard them with tp_plan entries"
                   " (colwise for a projection, rowwise for the one that reads its output), or use a smaller tp")
        if strict:
            raise ValueError(message + "; tp_strict=False lets the run go on with this plan.")
        rank_zero_warn(message + "; tp_strict=True makes this an error.")

    def describe(self) -> str:
        largest = ", ".join(f"{pattern} (x{count}, {numel:,})" for pattern, count, numel in self.replicated[:3])
        return (f"{self.share:.0%} of the parameters outside the embedding and head ({self.sharded:,} of"
                f" {self.total:,})" + (f"; largest left whole on every rank: {largest}" if largest else ""))


@dataclass
class TensorParallelPlan:
    """Everything ``apply_tensor_parallel`` will do, decided without communication."""

    tp_size: int
    styles: dict[str, ModuleStyle] = field(default_factory=dict)
    regions: dict[str, Region] = field(default_factory=dict)
    attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    config_attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    replicated: tuple[str, ...] = ()
    sequence_parallel: bool = False
    loss_parallel: bool = False
    classes: dict[str, str] = field(default_factory=dict)  # planned FQN -> class name, to spot pipeline cuts
    sources: dict[str, str] = field(default_factory=dict)  # FQN -> the tp_plan key that gave it its own style
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)  # peft-wrapped FQN -> its adapters
    coverage: Coverage | None = None  # set by plan_tensor_parallel

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1 and bool(self.styles)

    def restricted_to(self, module: nn.Module, held: Collection[str] | None = None) -> TensorParallelPlan:
        """The entries of this plan that ``module`` holds, so that a plan made on the whole model applies to a
        pipeline stage cut from it.

        ``held``: the FQNs (relative to ``module``) of the modules this rank holds, e.g. from the pipeline plan
        of its stages; an entry is kept when its FQN is one of them or lies inside one. ``None``: the whole
        module (``{""}``). Each kept entry must name a module of the planned class, else ``ValueError``.
        """
        planned = [*self.styles, *self.regions, *self.attributes, *self.config_attributes]
        held = {""} if held is None else held
        if isinstance(held, str) or not all(isinstance(h, str) for h in held):
            raise ValueError(f"held={held!r} must be a collection of module FQNs (strings), or None.")
        present = {fqn for fqn in planned if _under(fqn, held)}
        modules = dict(module.named_modules())
        for fqn in sorted(present):
            found = type(modules[fqn]).__name__ if fqn in modules else None
            if found != self.classes.get(fqn):
                what = f"holds a {found} there" if found else "has no such module"
                raise ValueError(
                    f"held names {fqn} (under {sorted(h for h in held if _under(fqn, [h]))}), planned as a "
                    f"{self.classes.get(fqn)}, but {type(module).__name__} {what}. Fix: pass in held only the "
                    "modules this rank holds, and plan on the module the stages were cut from."
                )
        return replace(
            self,
            styles={f: s for f, s in self.styles.items() if f in present},
            regions={f: r for f, r in self.regions.items() if f in present},
            attributes={f: a for f, a in self.attributes.items() if f in present},
            config_attributes={f: a for f, a in self.config_attributes.items() if f in present},
            adapters={f: a for f, a in self.adapters.items() if f in present},
        )

    def describe(self) -> str:
        tp = self.tp_size
        head = (
            f"tensor parallel plan: tp={tp}, sequence_parallel={self.sequence_parallel}, "
            f"loss_parallel={self.loss_parallel}"
        )
        if not self.enabled:
            return head + "\n  (tensor parallelism off: every rank holds and computes the whole module)"
        lines = [head]
        counts: dict[str, int] = {}
        for fqn in self.regions:
            counts[_pattern(fqn)] = counts.get(_pattern(fqn), 0) + 1
        for fqn, region in self.regions.items():
            pattern = _pattern(fqn)
            count = counts.pop(pattern, None)
            if count is None:
                continue
            if region.kind == "attention" and region.heads is not None:
                kv = f", kv heads {region.kv_heads}->{region.kv_heads // tp}" if region.kv_heads != region.heads else ""
                if region.kv_replicated:
                    kept = ", ".join(region.inputs[1:]) or f"the k and v rows of {region.inputs[0]}"
                    kv = (f", kv heads {region.kv_heads} < tp: {kept} whole on every rank (grads summed over tp),"
                          " 1 kv head used per rank")
                size = f"heads {region.heads}->{region.heads // tp}{kv}, head_dim {region.head_dim}"
            elif region.kind == "attention":
                size = f"width {region.inner}->{region.inner // tp}"
            else:
                size = f"intermediate {region.inner}->{region.inner // tp}"
            fused = (" fused, q rows sharded and permuted per rank" if region.fused and region.kv_replicated else
                     " fused, whole key/value groups per rank" if region.fused and not region.fused.moves(tp) else
                     " fused, permuted per rank" if region.fused else
                     " fused, interleaved per head" if region.interleaved else "")
            attrs = {
                **self.attributes.get(fqn, {}),
                **{f"config.{k}": v for k, v in self.config_attributes.get(fqn, {}).items()},
                **{f"{holder}.{k}": v for holder in region.holders
                   for k, v in self.attributes.get(_child(fqn, holder), {}).items()},
            }
            local = ("; local " + ", ".join(f"{k}={v}" for k, v in attrs.items())) if attrs else ""
            norms = f"; grads of {', '.join(region.head_norms)} summed over tp" if region.head_norms else ""
            if region.projection_norms:
                norms += (f"; {', '.join(region.projection_norms)} sharded with their projections (statistic"
                          " all-reduced over tp)")
            if region.head_embeddings:
                norms += f"; {', '.join(region.head_embeddings)} split by heads"
            if region.low_rank:
                rotary = (f" (grads of {region.shared_columns[0]}'s columns from {region.shared_columns[1]} on, read by"
                          " every head, summed over tp)") if region.shared_columns else ""
                norms += f"; low-rank {', '.join(region.low_rank)} whole on every rank{rotary}"
            lines.append(
                f"  {region.kind:<9} {pattern} (x{count}) [{', '.join(region.inputs)} -> {region.output}]{fused}: "
                f"{size}{local}{norms}"
            )
        grouped: dict[tuple[str, str, str], list[str]] = {}
        for fqn, style in self.styles.items():
            if style.role in ("attention", "mlp"):
                continue
            text = style.style + "".join(
                f", {k} {v}" for k, v in (("input", style.input), ("output", style.output)) if v
            )
            grouped.setdefault((style.role, text, self.sources.get(fqn, "")), []).append(fqn)
        for (role, text, key), fqns in grouped.items():
            if role == "user":  # per tp_plan entry, the modules it styled: a glob alone hides which got what
                shown = ", ".join(f"{f} ({self.classes.get(f, '?')})" for f in fqns[:3])
                more = f", ... ({len(fqns)} modules)" if len(fqns) > 3 else ""
                lines.append(f"  {role:<9} {key or fqns[0]!r}: {text} -> {shown}{more}")
                continue
            patterns = sorted({_pattern(f) for f in fqns})
            note = ""
            if role == "head" and self.loss_parallel and fqns and self.styles[fqns[0]].output is None:
                note = " (logits vocab-sharded inside tensor_parallel_context, gathered elsewhere)"
            lines.append(f"  {role:<9} {', '.join(patterns)}: {text}{note}")
        for fqn, attrs in self.attributes.items():
            if not _under(fqn, self.regions):
                lines.append(f"  divide    {fqn}: local {', '.join(f'{k}={v}' for k, v in attrs.items())}")
        lines += self._describe_adapters()
        if self.replicated:
            lines.append(f"  replicate {', '.join(self.replicated)}")
        if self.coverage is not None:
            lines.append(f"  sharded   {self.coverage.describe()}")
        return "\n".join(lines)


    def _describe_adapters(self) -> list[str]:
        """One line per base-layer style: the adapted layers (by pattern), their adapters and how they are placed."""
        grouped: dict[str, dict[str, dict[str, None]]] = {}  # style -> parent pattern -> layer names, in order
        names: dict[str, set[str]] = {}
        for fqn, adapters in self.adapters.items():
            style = self.styles[fqn].style if fqn in self.styles else "whole"
            parent, _, layer = _pattern(fqn).rpartition(".")
            grouped.setdefault(style, {}).setdefault(parent, {})[layer] = None
            names.setdefault(style, set()).update(adapters)
        lines = []
        for style, parents in grouped.items():
            layers = ", ".join(f"{parent}.{{{','.join(found)}}}" if len(found) > 1 else f"{parent}.{next(iter(found))}"
                               for parent, found in parents.items())
            lines.append(f"  adapters  {layers} (LoRA {', '.join(sorted(names[style]))}): {describe_factors(style)}")
        return lines


def _pattern(fqn: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", fqn)


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of nn.Linear or of transformers' Conv1D, whose weight is stored [in, out]; of the base
    layer of a peft-wrapped one."""
    module = base_layer(module)
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if _is_conv1d(module):
        return tuple(module.weight.shape)
    return None


def _is_conv1d(module: nn.Module) -> bool:
    module = base_layer(module)
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _int_attrs(obj: Any, names: Iterable[str]) -> dict[str, int]:
    values = getattr(obj, "__dict__", {})
    return {n: values[n] for n in names if type(values.get(n)) is int}


def _under(fqn: str, prefixes: Iterable[str]) -> bool:
    return any(p == "" or fqn == p or fqn.startswith(p + ".") for p in prefixes)


def _child(fqn: str, name: str) -> str:
    return f"{fqn}.{name}" if fqn else name


def _parameter_owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Every place each parameter is registered (more than one for tied weights): module path, module, name."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for fqn, m in module.named_modules(remove_duplicate=False):
        for name, p in compat.parameters_of(m).items():
            if p is not None:
                owners.setdefault(id(p), []).append((fqn, m, name))
    return owners
