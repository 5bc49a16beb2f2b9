"""Tensor, sequence and vocabulary parallelism for modules whose code stays unchanged.

``plan_tensor_parallel`` inspects a module without communicating and returns a
``TensorParallelPlan``; ``apply_tensor_parallel`` shards the module in place over a
1-D tensor-parallel ``DeviceMesh`` with DTensor ``parallelize_module`` styles.

How an unchanged module keeps computing the same function
---------------------------------------------------------
* Attention and MLP *regions* are found by child names and checked by shapes:
  q/k/v (or a fused qkv) column-wise, output projection row-wise; up/gate column-wise,
  down row-wise.  Inside a region activations are plain local tensors holding this
  rank's heads (or this rank's slice of the intermediate size).
* An attention region runs as if it were a 1/tp-wide copy of itself: integer size
  attributes (``n_head``, ``num_key_value_heads``, ``n_embd``, ``split_size``, ...) on
  the module, and on a private copy of its ``config`` object, are divided by tp, and
  the module's forward sees its hidden-state argument narrowed to hidden/tp columns
  while its projections still read the full activation.  So code such as
  ``B, T, C = x.size(); q.view(B, T, self.n_head, C // self.n_head)`` works as is.
* A fused qkv weight (GPT-2 ``Conv1D``, nanoGPT, litgpt GQA) is permuted once so
  that every rank's contiguous shard holds its own heads of q, k and v; state-dict
  hooks translate to and from the original layout, so checkpoints stay
  interchangeable with the single-device module.  Optimizer state of such a weight
  stays in the permuted layout, which depends on tp.
* Because a wrong head count trains a different model without failing,
  ``TensorParallelSelfCheck`` compares one sharded block of each type against an
  unsharded copy on the first real batch.

Vocabulary
----------
The token embedding is sharded row-wise (by vocabulary) and the LM head
column-wise.  Tied embedding/head weights stay one parameter.  With
``loss_parallel=True`` the head's logits stay sharded on the vocabulary dim only
inside ``tensor_parallel_context``: there, ``F.cross_entropy`` /
``nn.CrossEntropyLoss`` on them is computed vocabulary-parallel (the full logits are
never gathered) and returns a plain loss, while any other use of the logits
transparently sees gathered, plain logits.  So no detection of the user's loss is
needed, and outside the context (callbacks, generation) the head returns plain,
gathered logits.

Sequence parallelism (``sequence_parallel=True``)
-------------------------------------------------
Between regions activations are DTensors sharded on dim 1 (batch-first
``[B, T, C]`` is assumed): norms run on sequence shards (``SequenceParallel``), each
region all-gathers its input once and its row-wise projection reduce-scatters its
output (Megatron-style).  Code between regions sees global shapes, and plain tensors
it mixes in (masks, position tables) are treated as replicated.  Parameters outside
regions become replicated DTensors whose gradients are all-reduced after
accumulation.

Random state and dropout
------------------------
All tensor-parallel ranks start from the same seed.  Dropout on replicated
activations (everything between regions without sequence parallelism) draws the
same mask on every rank, as it must.  Dropout on sequence-sharded DTensor
activations goes through DTensor's RNG tracker, which on CUDA gives each shard its
own offset of one shared stream; on CPU DTensor warns that it has no tracker and
every shard draws from the same local stream.  Dropout inside a region (attention
probabilities) acts on each rank's own heads with the same local stream, so the
heads of rank 0 and rank 1 draw identical masks: still a valid dropout for every
head, but masks are correlated across the ranks' head groups, unlike on one device.

Integration (what a strategy calls)
-----------------------------------
1. setup: ``plan = plan_tensor_parallel(module, tp, tp_plan, ...)`` (raises
   ``ValueError`` before any collective; log ``plan.describe()``), then, after moving the
   module to its device, ``check = apply_tensor_parallel(module, mesh["tp"], plan)``.  With
   pipeline parallelism, plan on the whole model and apply the same plan to each stage.
   With sequence parallelism a stage's output is a DTensor sharded on dim 1; a plain stage
   input is read as replicated.
2. around every training/validation/test/predict step *and* around backward:
   ``with tensor_parallel_context(plan): ...``.
3. first training batch: ``check.arm()`` before the forward, ``check.verify()`` after it
   (collective over the tp group; raises ``TensorParallelCheckError``).
4. gradient clipping: ``clip_grad_norm_(params, max_norm, group=pp_group)``.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import fnmatch
import inspect
import math
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "FusedQKVLayout",
    "ModuleStyle",
    "Region",
    "TensorParallelCheckError",
    "TensorParallelPlan",
    "TensorParallelSelfCheck",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "plan_tensor_parallel",
    "tensor_parallel_context",
]

STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")

# (column-wise children, row-wise child); checked by shapes after matching names.
_ATTENTION_PRESETS = (
    (("q_proj", "k_proj", "v_proj"), "o_proj"),  # Hugging Face Llama/Mistral/Qwen, examples/gpt.py
    (("q_proj", "k_proj", "v_proj"), "out_proj"),
    (("wq", "wk", "wv"), "wo"),  # Meta / torchtitan Llama
)
_FUSED_ATTENTION_PRESETS = (
    ("c_attn", "c_proj"),  # GPT-2 (transformers Conv1D), nanoGPT (nn.Linear)
    ("qkv", "proj"),  # litgpt
)
_MLP_PRESETS = (
    (("gate_proj", "up_proj"), "down_proj"),  # Hugging Face, examples/gpt.py (up_proj only)
    (("w1", "w3"), "w2"),  # Meta / torchtitan
    (("c_fc",), "c_proj"),  # GPT-2, nanoGPT
    (("fc_1", "fc_2"), "proj"),  # litgpt LLaMAMLP
    (("fc",), "proj"),  # litgpt GptNeoxMLP
    (("fc1",), "fc2"),
)
_HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KV_HEAD_ATTRS = ("n_kv_heads", "n_kv_head", "num_key_value_heads", "num_kv_heads", "n_query_groups")
_WIDTH_ATTRS = ("n_embd", "embed_dim", "hidden_size", "all_head_size", "split_size", "d_model", "dim", "inner_dim")
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size")
_HIDDEN_ARG_NAMES = ("hidden_states", "x", "hidden", "input", "inputs", "query")
_SEQUENCE_DIM = 1


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class FusedQKVLayout:
    """Rows of a fused projection: ``q_heads`` then ``kv_heads`` then ``kv_heads`` heads of ``head_dim``."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dim: int  # output-feature dim of the weight: 0 for nn.Linear, 1 for Conv1D

    def permutation(self, tp: int) -> torch.Tensor:
        """Index that puts rank r's q, k and v heads next to each other in its contiguous shard."""
        widths = [self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        segments = torch.arange(sum(widths)).split(widths)
        return torch.cat([seg.chunk(tp)[r] for r in range(tp) for seg in segments])

    def to_tp(self, tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
        return tensor.index_select(dim, self.permutation(tp).to(tensor.device))

    def to_original(self, tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
        return tensor.index_select(dim, torch.argsort(self.permutation(tp)).to(tensor.device))


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
    fused: FusedQKVLayout | None = None
    head_norms: tuple[str, ...] = ()


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

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1 and bool(self.styles)

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        """``tensor_parallel_context(self)``, so that a strategy can enter the plan like its other step components."""
        return tensor_parallel_context(self)

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
                size = f"heads {region.heads}->{region.heads // tp}{kv}, head_dim {region.head_dim}"
            elif region.kind == "attention":
                size = f"width {region.inner}->{region.inner // tp}"
            else:
                size = f"intermediate {region.inner}->{region.inner // tp}"
            fused = " fused, permuted per rank" if region.fused else ""
            attrs = {
                **self.attributes.get(fqn, {}),
                **{f"config.{k}": v for k, v in self.config_attributes.get(fqn, {}).items()},
            }
            local = ("; local " + ", ".join(f"{k}={v}" for k, v in attrs.items())) if attrs else ""
            norms = f"; grads of {', '.join(region.head_norms)} summed over tp" if region.head_norms else ""
            lines.append(
                f"  {region.kind:<9} {pattern} (x{count}) [{', '.join(region.inputs)} -> {region.output}]{fused}: "
                f"{size}{local}{norms}"
            )
        grouped: dict[tuple[str, str], list[str]] = {}
        for fqn, style in self.styles.items():
            if style.role in ("attention", "mlp"):
                continue
            text = style.style + "".join(
                f", {k} {v}" for k, v in (("input", style.input), ("output", style.output)) if v
            )
            grouped.setdefault((style.role, text), []).append(fqn)
        for (role, text), fqns in grouped.items():
            patterns = sorted({_pattern(f) for f in fqns})
            note = ""
            if role == "head" and self.loss_parallel and fqns and self.styles[fqns[0]].output is None:
                note = " (logits vocab-sharded inside tensor_parallel_context, gathered elsewhere)"
            lines.append(f"  {role:<9} {', '.join(patterns)}: {text}{note}")
        for fqn, attrs in self.attributes.items():
            if fqn not in self.regions:
                lines.append(f"  divide    {fqn}: local {', '.join(f'{k}={v}' for k, v in attrs.items())}")
        if self.replicated:
            lines.append(f"  replicate {', '.join(self.replicated)}")
        return "\n".join(lines)


def _pattern(fqn: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", fqn)


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of nn.Linear or of transformers' Conv1D, whose weight is stored [in, out]."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if _is_conv1d(module):
        return tuple(module.weight.shape)
    return None


def _is_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _int_attrs(obj: Any, names: Iterable[str]) -> dict[str, int]:
    values = getattr(obj, "__dict__", {})
    return {n: values[n] for n in names if type(values.get(n)) is int}


def _parse_layout(text: str | None, where: str) -> Placement | None:
    if text is None:
        return None
    if text == "replicate":
        return Replicate()
    match = re.fullmatch(r"shard\((-?\d+)\)", str(text).replace(" ", ""))
    if match is None:
        raise ValueError(f"tp_plan entry {where!r}: layout {text!r} is not 'replicate' or 'shard(N)'.")
    return Shard(int(match.group(1)))


def _matches(pattern: str, fqn: str) -> bool:
    """Glob per dotted segment, as torch's parallelize_module does ('*' never crosses a dot)."""
    pattern_parts, parts = pattern.split("."), fqn.split(".")
    return len(pattern_parts) == len(parts) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, pattern_parts))


def _under(fqn: str, prefixes: Iterable[str]) -> bool:
    return any(p == "" or fqn == p or fqn.startswith(p + ".") for p in prefixes)


def _child(fqn: str, name: str) -> str:
    return f"{fqn}.{name}" if fqn else name


def _parse_user_plan(
    tp_plan: Mapping[str, Any], modules: dict[str, nn.Module], sequence_parallel: bool
) -> tuple[dict[str, ModuleStyle], list[str], dict[str, list[str]]]:
    """Expand globs to FQNs; returns (styles, replicated FQNs, attributes to divide per FQN)."""
    styles: dict[str, ModuleStyle] = {}
    replicated: list[str] = []
    divide: dict[str, list[str]] = {}
    names = [n for n in modules if n]
    for key, value in tp_plan.items():
        if isinstance(value, str):
            spec: dict[str, Any] = {"style": value}
        elif isinstance(value, Mapping):
            spec = dict(value)
        else:
            raise ValueError(f"tp_plan entry {key!r}: expected a style name or a mapping, got {value!r}.")
        unknown = set(spec) - {"style", "input", "output", "divide"}
        if unknown:
            raise ValueError(
                f"tp_plan entry {key!r}: unknown keys {sorted(unknown)}; allowed: style, input, output, divide."
            )
        style = spec.get("style")
        if style is not None and style not in STYLES:
            raise ValueError(f"tp_plan entry {key!r}: unknown style {style!r}; valid styles: {', '.join(STYLES)}.")
        if style is None and "divide" not in spec:
            raise ValueError(f"tp_plan entry {key!r} needs a 'style' ({', '.join(STYLES)}) or 'divide'.")
        if style == "sequence_parallel" and not sequence_parallel:
            raise ValueError(f"tp_plan entry {key!r}: style 'sequence_parallel' needs sequence_parallel=True.")
        for layout in ("input", "output"):
            _parse_layout(spec.get(layout), key)
        targets = [n for n in modules if _matches(key, n)]
        if not targets:
            close = difflib.get_close_matches(key, names, n=6, cutoff=0.4)
            close += [p for p in difflib.get_close_matches(key, sorted({_pattern(n) for n in names}), n=3, cutoff=0.4)]
            hint = f" Close module names: {', '.join(dict.fromkeys(close))}." if close else ""
            raise ValueError(f"tp_plan key {key!r} matches no module.{hint}")
        for fqn in targets:
            module = modules[fqn]
            if style in ("colwise", "rowwise") and not (
                _linear_shape(module) is not None or isinstance(module, nn.Embedding)
            ):
                raise ValueError(
                    f"tp_plan entry {key!r}: {fqn} is a {type(module).__name__}; '{style}' applies to "
                    "nn.Linear, transformers Conv1D and nn.Embedding only."
                )
            if style == "replicate":
                replicated.append(fqn)
            elif style is not None:
                styles[fqn] = ModuleStyle(style, spec.get("input"), spec.get("output"), "user")
            if "divide" in spec:
                names = spec["divide"]
                divide[fqn] = [names] if isinstance(names, str) else list(names)
    return styles, replicated, divide


def _head_geometry(module: nn.Module, q_width: int) -> tuple[int, int] | None:
    """(heads, head_dim) from the module's or its config's attributes, or None when unknown."""
    config = getattr(module, "config", None)
    for source in (module, config):
        head_dim = next(iter(_int_attrs(source, _HEAD_DIM_ATTRS).values()), None)
        if head_dim and q_width % head_dim == 0:
            return q_width // head_dim, head_dim
    for source in (module, config):
        heads = next(iter(_int_attrs(source, _HEAD_ATTRS).values()), None)
        if heads and q_width % heads == 0:
            return heads, q_width // heads
    return None


def _find_region(fqn: str, module: nn.Module, divide: dict[str, list[str]]) -> Region | None:
    linears = {n: _linear_shape(c) for n, c in module.named_children() if _linear_shape(c) is not None}
    for qkv, out in _ATTENTION_PRESETS:
        if out in linears and all(n in linears for n in qkv):
            (width, q_w), (k_in, k_w), (v_in, v_w) = (linears[n] for n in qkv)
            o_in, o_out = linears[out]
            if k_in == v_in == width == o_out and k_w == v_w and o_in == q_w:
                return _attention_region(fqn, module, qkv, out, width, q_w, k_w, None, divide)
    for fused, out in _FUSED_ATTENTION_PRESETS:
        if fused in linears and out in linears:
            (width, total), (q_w, o_out) = linears[fused], linears[out]
            if o_out == width and total > q_w and (total - q_w) % 2 == 0:
                return _attention_region(fqn, module, (fused,), out, width, q_w, (total - q_w) // 2, fused, divide)
    for ins, out in _MLP_PRESETS:
        present = tuple(n for n in ins if n in linears)
        if present and out in linears:
            width, inner = linears[present[0]]
            if all(linears[n] == (width, inner) for n in present) and linears[out] == (inner, width):
                _head_norms(fqn, module, (*present, out), None)
                return Region("mlp", present, out, width, inner)
    return _generic_mlp(module, linears)


def _generic_mlp(module: nn.Module, linears: dict[str, tuple[int, int]]) -> Region | None:
    """Two linears C->F->C and no other parameters: sharding F is exact for any elementwise middle."""
    if len(linears) != 2 or any(n.split(".")[0] not in linears for n, _ in module.named_parameters()):
        return None
    (a, (a_in, a_out)), (b, (b_in, b_out)) = linears.items()
    if (a_in, a_out) == (b_out, b_in) and a_in != a_out:
        return Region("mlp", (a,), b, a_in, a_out)
    return None


def _attention_region(
    fqn: str,
    module: nn.Module,
    inputs: tuple[str, ...],
    out: str,
    width: int,
    q_width: int,
    kv_width: int,
    fused: str | None,
    divide: dict[str, list[str]],
) -> Region | None:
    geometry = _head_geometry(module, q_width)
    if geometry is None:
        if fqn in divide and fused is None:
            return Region(
                "attention", inputs, out, width, q_width, head_norms=_head_norms(fqn, module, (*inputs, out), None)
            )
        attrs = ", ".join(_HEAD_ATTRS + _HEAD_DIM_ATTRS)
        raise ValueError(
            f"Cannot tell the head count of attention {fqn} ({type(module).__name__}): none of {attrs} is an "
            f"integer attribute of it or of its config. Fix: keep it unsharded with tp_plan: {{'{_pattern(fqn)}': "
            f"replicate}}, or, if its q/k/v projections are separate, name the attributes holding global sizes: "
            f"tp_plan: {{'{_pattern(fqn)}': {{divide: [my_num_heads]}}}}."
        )
    heads, head_dim = geometry
    if kv_width % head_dim:
        return None
    kv_heads = kv_width // head_dim
    layout = None
    if fused is not None:
        declared_kv = list(_int_attrs(module, _KV_HEAD_ATTRS).values()) + list(
            _int_attrs(getattr(module, "config", None), _KV_HEAD_ATTRS).values()
        )
        if kv_heads != heads and kv_heads not in declared_kv:
            return None  # e.g. a cross-attention k|v projection: no q segment, do not guess a layout
        layout = FusedQKVLayout(heads, kv_heads, head_dim, 1 if _is_conv1d(getattr(module, fused)) else 0)
    norms = _head_norms(fqn, module, (*inputs, out), head_dim)
    return Region("attention", inputs, out, width, q_width, heads, kv_heads, head_dim, layout, norms)


def _head_norms(fqn: str, module: nn.Module, projections: tuple[str, ...], head_dim: int | None) -> tuple[str, ...]:
    """Per-head norms inside a region (their grads get summed over tp); any other parameter is an error."""
    norms = []
    for name, child in module.named_modules():
        params = list(child.parameters(recurse=False))
        if not params or (name and name.split(".")[0] in projections):
            continue
        if name and "norm" in type(child).__name__.lower() and head_dim and all(p.numel() == head_dim for p in params):
            norms.append(name)
            continue
        raise ValueError(
            f"{fqn} ({type(module).__name__}) has parameters in {_child(fqn, name)} ({type(child).__name__}) that are "
            f"neither its projections nor a per-head norm of size head_dim; tensor parallelism cannot tell how to "
            f"shard them. Fix: keep it unsharded with tp_plan: {{'{_pattern(fqn)}': replicate}}."
        )
    return tuple(norms)


def _size_attributes(source: Any, region: Region) -> dict[str, int]:
    """Integer attributes holding this attention's global head counts or widths."""
    attrs = {n: v for n, v in _int_attrs(source, _HEAD_ATTRS).items() if v == region.heads}
    attrs.update({n: v for n, v in _int_attrs(source, _KV_HEAD_ATTRS).items() if v == region.kv_heads})
    attrs.update({n: v for n, v in _int_attrs(source, _WIDTH_ATTRS).items() if v in (region.width, region.inner)})
    return attrs


def _divided(fqn: str, attrs: dict[str, int], tp: int) -> dict[str, int]:
    for name, value in attrs.items():
        if value % tp:
            raise ValueError(
                f"{fqn}.{name} = {value} is not divisible by tp={tp}. Fix: choose a tensor-parallel size that "
                f"divides it, or keep the module unsharded with tp_plan: "
                f"{{'{_pattern(fqn.removesuffix('.config'))}': replicate}}."
            )
    return {name: value // tp for name, value in attrs.items()}


def plan_tensor_parallel(
    module: nn.Module,
    tp_size: int,
    tp_plan: str | Mapping[str, Any] | None = "auto",
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
) -> TensorParallelPlan:
    """Decide how to shard ``module`` over ``tp_size`` ranks; pure, so errors surface before any collective.

    ``tp_plan``: ``"auto"``; ``None``/``"none"`` (tensor parallelism off); or a mapping from
    glob FQNs (``*`` matches one dotted segment) to a style name (``colwise``, ``rowwise``,
    ``sequence_parallel``, ``replicate`` to exclude a module and everything under it) or to
    ``{style, input, output, divide}``, merged over the automatic plan.  ``divide`` lists
    integer attributes holding global sizes (head counts, widths) to divide by tp.
    ``loss_parallel``: keep LM-head logits vocabulary-sharded inside ``tensor_parallel_context``.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}.")
    if tp_plan is None or tp_plan == "none":
        return TensorParallelPlan(tp_size, sequence_parallel=sequence_parallel)
    if tp_plan != "auto" and not isinstance(tp_plan, Mapping):
        raise ValueError(
            f"tp_plan must be 'auto', 'none', None or a mapping of module globs to styles, got {tp_plan!r}."
        )
    modules = dict(module.named_modules())
    user = tp_plan if isinstance(tp_plan, Mapping) else {}
    user_styles, replicated, divide = _parse_user_plan(user, modules, sequence_parallel)
    plan = TensorParallelPlan(tp_size, replicated=tuple(replicated), sequence_parallel=sequence_parallel)
    if tp_size == 1:
        return plan

    for fqn, m in modules.items():
        if isinstance(m, nn.MultiheadAttention) and not _under(fqn, replicated):
            parent = _pattern(fqn).rsplit(".", 1)[0] + "." if "." in fqn else ""
            raise ValueError(
                f"{fqn} is an nn.MultiheadAttention: it computes its heads inside F.multi_head_attention_forward "
                "from one fused in_proj_weight, which cannot be sharded without changing its code. Fix: use an "
                "attention module built from nn.Linear q/k/v projections, or keep it replicated and shard only the "
                f"feed-forward, e.g. tp_plan: {{'{_pattern(fqn)}': replicate, '{parent}linear1': colwise, "
                f"'{parent}linear2': rowwise}}."
            )

    for fqn, m in modules.items():
        if _under(fqn, replicated) or _under(fqn, list(plan.regions)):
            continue
        region = _find_region(fqn, m, divide)
        if region is None or any(_under(_child(fqn, n), replicated) for n in (*region.inputs, region.output)):
            continue
        _check_region(fqn, m, region, tp_size)
        plan.regions[fqn] = region
        for name in region.inputs:
            plan.styles[_child(fqn, name)] = ModuleStyle("colwise", role=region.kind)
        rowwise_output = f"shard({_SEQUENCE_DIM})" if sequence_parallel else None
        plan.styles[_child(fqn, region.output)] = ModuleStyle("rowwise", output=rowwise_output, role=region.kind)
        if region.kind == "attention" and fqn not in divide:
            attrs = _divided(fqn, _size_attributes(m, region), tp_size)
            config = getattr(m, "config", None)
            config_attrs = (
                _divided(f"{fqn}.config", _size_attributes(config, region), tp_size) if config is not None else {}
            )
            if attrs:
                plan.attributes[fqn] = attrs
            if config_attrs:
                plan.config_attributes[fqn] = config_attrs
    for fqn, names in divide.items():
        attrs = _int_attrs(modules[fqn], names)
        missing = [n for n in names if n not in attrs]
        if missing:
            raise ValueError(
                f"tp_plan entry for {fqn}: 'divide' names {missing}, which are not integer attributes of it."
            )
        plan.attributes[fqn] = _divided(fqn, attrs, tp_size)

    _plan_vocabulary(plan, modules, replicated, sequence_parallel, loss_parallel)
    if sequence_parallel:
        for fqn, m in modules.items():
            if (
                "norm" in type(m).__name__.lower()
                and not list(m.children())
                and fqn not in plan.styles
                and not _under(fqn, replicated)
                and not _under(fqn, list(plan.regions))
            ):
                plan.styles[fqn] = ModuleStyle("sequence_parallel", role="norm")

    if not plan.styles and not user_styles:
        found = [
            f"{n} ({type(m).__name__} {_linear_shape(m)[0]}->{_linear_shape(m)[1]})"
            for n, m in modules.items()
            if _linear_shape(m)
        ]
        listing = "\n  ".join(found[:20]) or "(none)"
        raise ValueError(
            f"tp={tp_size} but nothing in {type(module).__name__} can be sharded automatically: no attention "
            "(q/k/v -> output projection), MLP (up/gate -> down) or vocabulary embedding was recognised. "
            f"Linear modules found:\n  {listing}\nFix: name the pairs to shard in tp_plan, e.g. in YAML:\n"
            '  tp_plan:\n    "blocks.*.ff.fc_in": colwise\n    "blocks.*.ff.fc_out": rowwise\n'
            "or use tp=1."
        )
    for fqn, style in user_styles.items():
        auto = plan.styles.get(fqn)
        if auto is not None and auto.style == style.style:  # keep the automatic layouts and role the user left out
            style = ModuleStyle(style.style, style.input or auto.input, style.output or auto.output, auto.role)
        plan.styles[fqn] = style
    head = [s for s in plan.styles.values() if s.role == "head"]
    plan.loss_parallel = loss_parallel and bool(head) and head[0].output is None
    _check_ties(plan, module)
    planned = {*plan.styles, *plan.regions, *plan.attributes, *plan.config_attributes}
    plan.classes = {fqn: type(modules[fqn]).__name__ for fqn in planned}
    return plan


def _check_region(fqn: str, module: nn.Module, region: Region, tp: int) -> None:
    kind = type(module).__name__
    if region.kind == "attention" and region.heads is not None:
        for what, count in (("attention heads", region.heads), ("key/value heads", region.kv_heads)):
            if count % tp:
                raise ValueError(
                    f"{fqn} ({kind}) has {count} {what}, not divisible by tp={tp}. Fix: choose a tensor-parallel "
                    f"size that divides {count}, or keep it unsharded with tp_plan: {{'{_pattern(fqn)}': replicate}}."
                )
    # An MLP's width is never split (its row-wise output is all-reduced whole); an attention's code sees the
    # hidden state narrowed to width/tp.
    sizes = [("intermediate size" if region.kind == "mlp" else "attention width", region.inner)]
    if region.kind == "attention":
        sizes.append(("hidden size", region.width))
    for size, value in sizes:
        if value % tp:
            raise ValueError(
                f"{fqn} ({kind}) has {size} {value}, not divisible by tp={tp}. Fix: choose a tensor-parallel size "
                f"that divides {value}, or tp_plan: {{'{_pattern(fqn)}': replicate}}."
            )


def _plan_vocabulary(
    plan: TensorParallelPlan, modules: dict[str, nn.Module], replicated: list[str], sp: bool, loss_parallel: bool
) -> None:
    """Token embedding row-wise and the LM head (a linear C->V outside regions) column-wise."""
    embeddings = [f for f in modules if isinstance(modules[f], nn.Embedding)]
    if not embeddings:
        return
    emb_fqn = max(embeddings, key=lambda f: modules[f].num_embeddings)
    if _under(emb_fqn, replicated):
        return
    outside = [f for f in modules if not _under(f, replicated) and not _under(f, list(plan.regions))]
    emb = modules[emb_fqn]
    vocab, dim = emb.num_embeddings, emb.embedding_dim
    heads = [
        f
        for f in outside
        if _linear_shape(modules[f]) == (dim, vocab)
        and f not in plan.styles
        and not any(part.isdigit() for part in f.split("."))  # an LM head is not inside repeated blocks
    ]
    heads.sort(key=lambda f: getattr(modules[f], "weight", None) is not emb.weight)
    if vocab % plan.tp_size:
        raise ValueError(
            f"Vocabulary size {vocab} of {emb_fqn} is not divisible by tp={plan.tp_size}. Fix: pad the vocabulary "
            f"to a multiple of {plan.tp_size} (e.g. {math.ceil(vocab / 64) * 64}), or keep it unsharded with "
            f"tp_plan: {{'{emb_fqn}': replicate{''.join(f', {h!r}: replicate' for h in heads[:1])}}}."
        )
    plan.styles[emb_fqn] = ModuleStyle(
        "rowwise", input="replicate", output=f"shard({_SEQUENCE_DIM})" if sp else "replicate", role="embedding"
    )
    if heads:
        plan.styles[heads[0]] = ModuleStyle("colwise", output=None if loss_parallel else "replicate", role="head")


def _weight_sharding(module: nn.Module, style: ModuleStyle | None) -> str:
    if style is None or style.style in ("sequence_parallel",):
        return "replicated"
    if isinstance(module, nn.Embedding):
        return f"shard({0 if style.style == 'rowwise' else 1})"
    conv = _is_conv1d(module)
    return f"shard({int(conv) if style.style == 'colwise' else int(not conv)})"


def _parameter_owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Every place each parameter is registered (more than one for tied weights): module path, module, name."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for fqn, m in module.named_modules(remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((fqn, m, name))
    return owners


def _check_ties(plan: TensorParallelPlan, module: nn.Module) -> None:
    for owners in _parameter_owners(module).values():
        tied = [(fqn, name) for fqn, _, name in owners]
        shardings = {
            (
                _weight_sharding(module.get_submodule(f), plan.styles.get(f))
                if n == "weight"
                else ("replicated" if f not in plan.styles else "sharded")
            )
            for f, n in tied
        }
        if len({f for f, _ in tied}) > 1 and len(shardings) > 1:
            names = ", ".join(f"{f}.{n}" for f, n in tied)
            raise ValueError(
                f"Tied parameters {names} would be sharded differently ({', '.join(sorted(shardings))}); tied weights "
                "must stay one parameter. Fix: give the tied modules matching tp_plan styles (embedding rowwise with "
                "LM head colwise), or replicate all of them."
            )


# --------------------------------------------------------------------------- styles


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Conv1DAware:
    """Lets a linear style also take transformers' Conv1D (weight stored [in, out]): ``_conv1d`` gives its
    parameters' placements, and ``_conv1d_input`` the input layout it needs (None: the style's own)."""

    _conv1d: dict[str, Placement]
    _conv1d_input: tuple[Placement, ...] | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        if self._conv1d_input is not None:
            self.desired_input_layouts = self._conv1d_input
        return distribute_module(
            module,
            device_mesh,
            lambda _, m, mesh: _distribute_params(m, mesh, self._conv1d, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _Colwise(_Conv1DAware, ColwiseParallel):
    _conv1d = {"weight": Shard(1), "bias": Shard(0)}


class _Rowwise(_Conv1DAware, RowwiseParallel):
    _conv1d = {"weight": Shard(0), "bias": Replicate()}
    _conv1d_input = (Shard(-1),)


class _SequenceParallel(SequenceParallel):
    """SequenceParallel that reads a plain input as replicated, which every plain activation between regions is."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        if x.placements != sequence_sharding:
            x = x.redistribute(placements=sequence_sharding)
        return (x, *inputs[1:])


def _torch_style(style: ModuleStyle, module: nn.Module) -> nn.Module:
    inp, out = _parse_layout(style.input, style.style), _parse_layout(style.output, style.style)
    if style.style == "sequence_parallel":
        return _SequenceParallel(sequence_dim=_SEQUENCE_DIM)
    if style.style == "colwise":
        keep_dtensor = style.role == "head" and out is None  # vocab-sharded logits, see _vocab_head_output
        return _Colwise(input_layouts=inp, output_layouts=out, use_local_output=not keep_dtensor)
    if isinstance(module, nn.Embedding) and inp is None:
        inp = Replicate()  # token ids are never sharded
    keep_dtensor = isinstance(out, Shard)  # sequence-sharded output stays a DTensor between regions
    return _Rowwise(input_layouts=inp, output_layouts=out, use_local_output=not keep_dtensor)


# --------------------------------------------------------------------------- context


_local = threading.local()


def _replication_enter() -> None:
    """Re-entrant implicit replication: plain tensors meeting DTensors outside regions are replicated values."""
    depth = getattr(_local, "replication_depth", 0)
    if depth == 0:
        _local.replication = implicit_replication()
        _local.replication.__enter__()
    _local.replication_depth = depth + 1


def _replication_exit() -> None:
    _local.replication_depth -= 1
    if _local.replication_depth == 0:
        _local.replication.__exit__(None, None, None)


_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
    torch.Tensor.__len__, torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.get_device,
    torch.Tensor.is_floating_point, torch.Tensor.ndimension,
}  # fmt: skip
_VOCAB_KEEPING = {
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.to,
    torch.Tensor.contiguous, torch.Tensor.__getitem__, torch.Tensor.transpose, torch.transpose,
    torch.Tensor.permute, torch.permute, torch.Tensor.squeeze, torch.Tensor.unsqueeze,
}  # fmt: skip
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_TAG = "_lightning_4d_vocab_sharded"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy on vocab-sharded logits with loss_parallel's ops active in backward too, returning a plain loss."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction):
        with torch.enable_grad(), loss_parallel():
            ctx.leaf = logits.detach().requires_grad_()
            ctx.loss = F.cross_entropy(ctx.leaf, target, weight=weight, ignore_index=ignore_index, reduction=reduction)
        return ctx.loss.detach().to_local()

    @staticmethod
    def backward(ctx, grad):
        grad = DTensor.from_local(grad, ctx.loss.device_mesh, ctx.loss.placements, run_check=False)
        with loss_parallel():
            (logits_grad,) = torch.autograd.grad(ctx.loss, ctx.leaf, grad)
        del ctx.leaf, ctx.loss
        return logits_grad, None, None, None, None


class _VocabShardedLogits(TorchFunctionMode):
    """Routes cross entropy on vocab-sharded logits through loss_parallel and gathers them for any other use."""

    def __init__(self) -> None:
        super().__init__()
        self.live = False
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def track(self, logits: DTensor) -> DTensor:
        setattr(logits, _TAG, True)
        self.live = True
        return logits

    def _gather(self, t: Any) -> Any:
        if not getattr(t, _TAG, False):
            return t
        if id(t) not in self.gathered:
            self.gathered[id(t)] = (t, t.full_tensor())
        return self.gathered[id(t)][1]

    def _keep_or_gather(self, out: Any) -> Any:
        if isinstance(out, DTensor):
            if any(p.is_shard() for p in out.placements):
                return self.track(out)
            return out.full_tensor()
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.live or not any(getattr(a, _TAG, False) for a in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            logits, target = a["input"], a["target"]
            if (
                getattr(logits, _TAG, False)
                and logits.dim() >= 2
                and logits.placements == (Shard(1),)
                and not isinstance(target, DTensor)
                and not target.is_floating_point()
                and a["label_smoothing"] == 0.0
                and a["size_average"] is None
                and a["reduce"] is None
            ):
                if torch.is_grad_enabled() and logits.requires_grad:
                    return _VocabParallelCrossEntropy.apply(
                        logits, target, a["weight"], a["ignore_index"], a["reduction"]
                    )
                with loss_parallel():
                    loss = F.cross_entropy(
                        logits, target, weight=a["weight"], ignore_index=a["ignore_index"], reduction=a["reduction"]
                    )
                return loss.to_local()
        if func in _VOCAB_KEEPING and not any(
            isinstance(a, torch.Tensor) and not getattr(a, _TAG, False) for a in tree_flatten((args, kwargs))[0]
        ):
            return tree_map(self._keep_or_gather, func(*args, **kwargs))
        args, kwargs = tree_map(self._gather, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def tensor_parallel_context(plan: TensorParallelPlan) -> Iterator[None]:
    """Wrap every step (forward and loss) and every backward of a model sharded with ``plan``.

    Inside, LM-head logits stay vocab-sharded for cross entropy (``plan.loss_parallel``) and,
    with sequence parallelism, plain tensors that meet sequence-sharded activations, also in
    backward, are treated as replicated.
    """
    with contextlib.ExitStack() as stack:
        if plan.enabled and plan.sequence_parallel:
            _replication_enter()
            stack.callback(_replication_exit)
        if plan.enabled and plan.loss_parallel:
            mode = _VocabShardedLogits()
            previous = getattr(_local, "logits_mode", None)
            _local.logits_mode = mode
            stack.callback(setattr, _local, "logits_mode", previous)
            stack.enter_context(mode)
        yield


def _vocab_head_output(module: nn.Module, inputs: Any, output: DTensor) -> torch.Tensor:
    mode = getattr(_local, "logits_mode", None)
    return output.full_tensor() if mode is None else mode.track(output)


# --------------------------------------------------------------------------- apply


def _hidden_argument(args: tuple, kwargs: dict) -> tuple[int | str | None, Any]:
    if args and isinstance(args[0], torch.Tensor):
        return 0, args[0]
    for name in _HIDDEN_ARG_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return name, kwargs[name]
    return None, None


def _replace_argument(args: tuple, kwargs: dict, key: int | str, value: Any) -> tuple[tuple, dict]:
    if key == 0:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, key: value}


class _RegionHooks:
    """Gathers a sequence-sharded region input once and, for attention, narrows what the module's own code sees."""

    def __init__(self, fqn: str, module: nn.Module, region: Region, mesh: DeviceMesh) -> None:
        self.fqn, self.region, self.mesh = fqn, region, mesh
        self.swap: tuple[torch.Tensor, torch.Tensor] | None = None
        module.register_forward_pre_hook(self.pre, with_kwargs=True)
        module.register_forward_hook(self.post, always_call=True)
        if region.kind == "attention":
            for name in region.inputs:
                projection = module.get_submodule(name)
                projection.register_forward_pre_hook(
                    partial(self.projection_pre, name, _linear_shape(projection)[0]), prepend=True
                )

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        key, x = _hidden_argument(args, kwargs)
        if key is None:
            return None
        full = x.redistribute(self.mesh, [Replicate()]) if isinstance(x, DTensor) else x
        if self.region.kind == "mlp":
            return _replace_argument(args, kwargs, key, full)
        local = full.to_local() if isinstance(full, DTensor) else full
        if local.shape[-1] != self.region.width:
            raise RuntimeError(
                f"Attention {self.fqn} got a hidden state of width {local.shape[-1]}, expected {self.region.width}."
            )
        narrowed = local.narrow(-1, 0, self.region.width // self.mesh.size())
        self.swap = (narrowed, full)
        return _replace_argument(args, kwargs, key, narrowed)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.swap = None

    def projection_pre(self, name: str, in_features: int, module: nn.Module, args: tuple) -> tuple | None:
        if self.swap is not None and args and args[0] is self.swap[0]:
            return (self.swap[1], *args[1:])
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[-1] != in_features:
            raise RuntimeError(
                f"{self.fqn}.{name} received width {args[0].shape[-1]} instead of {in_features}: under tensor "
                f"parallelism attention {self.fqn} sees its hidden state narrowed to 1/{self.mesh.size()} and only "
                f"the same tensor object passed straight to its projections is widened again. Fix: pass the hidden "
                f"state unchanged to {name}, or keep the module unsharded with tp_plan: "
                f"{{'{_pattern(self.fqn)}': replicate}}."
            )
        return None


def _sum_over(group: dist.ProcessGroup):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def _grad_like_param(param: nn.Parameter) -> None:
    """Give a gradient its parameter's layout, which optimizers and data-parallel buckets rely on: replicated
    parameters used on sharded activations accumulate Partial gradients, and DTensor's embedding backward
    returns a replicated gradient for a vocabulary-sharded weight."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def _fused_state_dict_hooks(module: nn.Module, layout: FusedQKVLayout, tp: int) -> None:
    """Checkpoints keep the original q|k|v layout; only the live parameter is permuted."""
    dims = {"weight": layout.dim, "bias": 0}

    def to_original(mod, state_dict, prefix, local_metadata):
        for name, dim in dims.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):
                full = layout.to_original(value.full_tensor(), tp, dim)
                state_dict[prefix + name] = distribute_tensor(
                    full, value.device_mesh, value.placements, src_data_rank=None
                )
            elif value is not None:
                state_dict[prefix + name] = layout.to_original(value, tp, dim)

    def to_tp(mod, state_dict, prefix, *args):
        for name, dim in dims.items():
            value, param = state_dict.get(prefix + name), getattr(mod, name, None)
            if value is None or param is None:
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value
            permuted = layout.to_tp(full, tp, dim)
            if isinstance(param, DTensor):
                permuted = distribute_tensor(permuted, param.device_mesh, param.placements, src_data_rank=None)
            state_dict[prefix + name] = permuted

    module.register_state_dict_post_hook(to_original)
    module.register_load_state_dict_pre_hook(to_tp)


def _common_prefix(fqns: Iterable[str]) -> str:
    parts = [f.split(".") if f else [] for f in fqns]
    prefix = []
    for segment in zip(*parts):
        if len(set(segment)) != 1:
            break
        prefix.append(segment[0])
    return ".".join(prefix)


def _to_replicated(mesh: DeviceMesh, args: tuple) -> tuple:
    return tuple(
        (
            DTensor.from_local(a, mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
        )
        for a in args
    )


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, *, self_check: bool = True
) -> TensorParallelSelfCheck | None:
    """Shard ``module`` in place; returns an (unarmed) self-check, or None when off or nothing is sharded.

    Collective over ``tp_mesh``: every rank must call it with an identically initialised module.
    ``module`` may be a pipeline stage cut from the module the plan was made for: entries for
    modules the stage no longer holds (or holds replaced, e.g. by ``nn.Identity``, or as a stand-in whose
    parameters became buffers) are skipped. Plan on the whole model, so that the last stage still knows its
    LM head. Parameters are replaced by new DTensor parameters: collect them for an optimizer afterwards.
    """
    if not plan.enabled:
        return None
    if tp_mesh.ndim != 1 or tp_mesh.size() != plan.tp_size:
        raise ValueError(
            f"The plan is for tp={plan.tp_size} but the mesh has shape {tuple(tp_mesh.shape)}; pass mesh['tp']."
        )
    tp = plan.tp_size
    present = {
        fqn
        for fqn, m in module.named_modules()
        if type(m).__name__ == plan.classes.get(fqn) and not {"weight", "bias"} & set(m._buffers)
    }
    plan = replace(
        plan,
        styles={f: s for f, s in plan.styles.items() if f in present},
        regions={f: r for f, r in plan.regions.items() if f in present},
        attributes={f: a for f, a in plan.attributes.items() if f in present},
        config_attributes={f: a for f, a in plan.config_attributes.items() if f in present},
    )
    replicas = _check_replicas(module, plan) if self_check else {}

    owners = _parameter_owners(module)

    for fqn, region in plan.regions.items():
        owner = module.get_submodule(fqn)
        if region.fused is not None:
            fused = owner.get_submodule(region.inputs[0])
            with torch.no_grad():
                for name, dim in (("weight", region.fused.dim), ("bias", 0)):
                    param = getattr(fused, name, None)
                    if param is not None:
                        param.copy_(region.fused.to_tp(param, tp, dim))
            _fused_state_dict_hooks(fused, region.fused, tp)
    for fqn, attrs in plan.attributes.items():
        for name, value in attrs.items():
            setattr(module.get_submodule(fqn), name, value)
    for fqn, attrs in plan.config_attributes.items():
        owner = module.get_submodule(fqn)
        owner.config = copy.copy(owner.config)
        for name, value in attrs.items():
            setattr(owner.config, name, value)

    for fqn, style in plan.styles.items():
        target = module.get_submodule(fqn)
        parallelize_module(target, tp_mesh, _torch_style(style, target))
        if style.role == "head" and plan.loss_parallel:
            target.register_forward_hook(_vocab_head_output)

    group = tp_mesh.get_group()
    for fqn, region in plan.regions.items():
        owner = module.get_submodule(fqn)
        if region.kind == "attention" or plan.sequence_parallel:
            _RegionHooks(fqn, owner, region, tp_mesh)
        for name in region.head_norms:
            for param in owner.get_submodule(name).parameters():
                param.register_hook(_sum_over(group))

    if plan.sequence_parallel and plan.styles:
        inside = list(plan.styles) + list(plan.regions)
        for fqn, m in module.named_modules():
            if _under(fqn, inside) or not m._parameters:
                continue
            _distribute_params(m, tp_mesh, {n: Replicate() for n in m._parameters if m._parameters[n] is not None}, 0)
            if not list(m.children()):
                m.register_forward_pre_hook(lambda mod, args: _to_replicated(tp_mesh, args))
        root = module.get_submodule(_common_prefix(inside))
        root.register_forward_pre_hook(lambda *_: _replication_enter())
        root.register_forward_hook(lambda *_: _replication_exit(), always_call=True)

    for tied in owners.values():  # parallelize_module replaced each registration on its own: tie them again
        _, first_module, first_name = tied[0]
        shared = first_module._parameters[first_name]
        for _, m, name in tied[1:]:
            m.register_parameter(name, shared)
    for param in module.parameters():  # deduplicated, so tied parameters get one hook
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_grad_like_param)
    if not replicas:
        return None
    return TensorParallelSelfCheck(
        {fqn: (module.get_submodule(fqn), replica) for fqn, replica in replicas.items()}, tp_mesh, plan
    )


# --------------------------------------------------------------------------- self-check


class TensorParallelCheckError(RuntimeError):
    """A sharded block computes something else than its unsharded copy."""


def _check_replicas(module: nn.Module, plan: TensorParallelPlan) -> dict[str, nn.Module]:
    """Unsharded copies of the first block of each type whose children get column/row-wise styles; a container
    without a forward of its own (an ``nn.ModuleDict`` whose children the parent calls) is never called, so it has
    nothing to compare."""
    replicas: dict[str, nn.Module] = {}
    kinds: set[type] = set()
    for fqn, style in plan.styles.items():
        if (
            style.role not in ("attention", "mlp", "user")
            or style.style not in ("colwise", "rowwise")
            or "." not in fqn
        ):
            continue
        parent_fqn = fqn.rsplit(".", 1)[0]
        parent = module.get_submodule(parent_fqn)
        if (
            isinstance(module.get_submodule(fqn), nn.Embedding)
            or type(parent) in kinds
            or type(parent).forward is nn.Module.forward
        ):
            continue
        kinds.add(type(parent))
        replicas[parent_fqn] = copy.deepcopy(parent)
    return replicas


def _sequence(value: tuple | list, items: Iterable[Any]) -> tuple | list:
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples take positionals


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return _sequence(value, [_snapshot(v) for v in value])
    if isinstance(value, dict) and type(value) is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:  # objects that cannot be copied (handles, generators) are passed as they are
        return value


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (tuple, list)):
        return _sequence(value, [_full(v) for v in value])
    if isinstance(value, dict) and type(value) is dict:
        return {k: _full(v) for k, v in value.items()}
    return value


class TensorParallelSelfCheck:
    """Compares each distinct sharded block with its unsharded copy on the first real input.

    ``arm()`` before a forward captures every checked block's input once; ``verify()`` afterwards
    (collective over the tp group) runs the sharded block and its copy in eval mode under
    ``no_grad`` on that input, compares the first tensor each returns, raises
    ``TensorParallelCheckError`` on every rank if one differs by more than ``rtol`` (relative to
    the copy's largest value; default 1e-4 for fp32, 16 eps otherwise), and frees the copies.
    """

    def __init__(
        self,
        targets: dict[str, tuple[nn.Module, nn.Module]],
        mesh: DeviceMesh,
        plan: TensorParallelPlan,
        rtol: float | None = None,
    ) -> None:
        self.targets, self.mesh, self.plan, self.rtol = targets, mesh, plan, rtol
        self.captured: dict[str, tuple[tuple, dict]] = {}
        self._handles: list[Any] = []

    def arm(self) -> None:
        for fqn, (block, _) in self.targets.items():
            self._handles.append(
                block.register_forward_pre_hook(partial(self._capture, fqn), with_kwargs=True, prepend=True)
            )

    def _capture(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if fqn not in self.captured:
            self.captured[fqn] = (_snapshot(args), _snapshot(kwargs))

    @torch.no_grad()
    def verify(self, failed: bool = False) -> dict[str, float]:
        """Returns the relative error per checked block; raises TensorParallelCheckError on a mismatch.

        ``failed``: the armed forward raised. Only the blocks that got an input are checked, so that a sharded
        block that cannot run at all (a size attribute left global breaks its ``view``) is named.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        missing = [fqn for fqn in self.targets if fqn not in self.captured]
        if missing and not failed:
            raise RuntimeError(
                f"Tensor-parallel self-check: no input captured for {missing}; call arm() before a forward."
            )
        checked = [fqn for fqn in self.targets if fqn in self.captured]
        errors, tolerances, raised = [], [], {}
        for fqn in checked:
            block, replica = self.targets[fqn]
            args, kwargs = self.captured[fqn]
            # The copy was made before sharding; a checkpoint restore or ``init_from`` has replaced the weights
            # since. The block's state_dict is in the original layout (fused q|k|v un-permuted).
            replica.load_state_dict({k: _full(v) for k, v in block.state_dict().items()})
            reference = self._run(replica, _full(_snapshot(args)), _full(_snapshot(kwargs)))
            try:
                sharded = self._run(block, _snapshot(args), _snapshot(kwargs))
            except Exception as error:  # noqa: BLE001  reported below, after every rank has taken part
                raised[fqn], sharded = f"{type(error).__name__}: {error}", None
            if reference is None:
                raise RuntimeError(f"Tensor-parallel self-check: {fqn} returned no tensor.")
            eps = torch.finfo(reference.dtype).eps if reference.is_floating_point() else 0.0
            tolerances.append(
                self.rtol if self.rtol is not None else (1e-4 if reference.dtype == torch.float32 else 16 * eps)
            )
            if sharded is None or sharded.shape != reference.shape:
                errors.append(math.inf)
            else:
                scale = reference.abs().max().clamp_min(1e-12)
                errors.append(((sharded.float() - reference.float()).abs().max() / scale).item())
        worst = torch.tensor(errors, dtype=torch.float64)
        if checked:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
        result = dict(zip(checked, worst.tolist()))
        self.targets, self.captured = {}, {}
        for (fqn, err), tol in zip(result.items(), tolerances):
            if not err <= tol:
                what = (
                    f"the sharded block raised {raised[fqn]}, while its unsharded copy runs"
                    if fqn in raised
                    else f"the sharded block's output differs from its unsharded copy by {err:.3g} (relative; "
                    f"tolerance {tol:.1g}), so it would train as a different model"
                )
                raise TensorParallelCheckError(
                    f"Tensor-parallel self-check failed for {fqn}: {what}. Likely cause: a head-count or width "
                    f"attribute not divided by tp={self.plan.tp_size} (divided: {self.plan.attributes.get(fqn, {})}),"
                    f" or a tp_plan entry that does not fit the module's code. Fix: name the size attributes with "
                    f"tp_plan: {{'{_pattern(fqn)}': {{divide: [...]}}}}, "
                    f"or keep it unsharded with tp_plan: {{'{_pattern(fqn)}': replicate}}."
                )
        return result

    def _run(self, block: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
        modes = [(m, m.training) for m in block.modules()]
        block.eval()
        try:
            with contextlib.ExitStack() as stack:
                if self.plan.sequence_parallel:
                    _replication_enter()
                    stack.callback(_replication_exit)
                out = _first_tensor(block(*args, **kwargs))
            return out.full_tensor() if isinstance(out, DTensor) else out
        finally:
            for m, mode in modes:
                m.training = mode


# --------------------------------------------------------------------------- clipping


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    group: dist.ProcessGroup | None = None,
    skip_in_norm: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip by the true global norm over plain and DTensor gradients; returns that norm.

    DTensor gradients count their shards once per mesh dim they are sharded on (one
    all-reduce per distinct mesh/placement); plain gradients are replicated copies and count
    once.  ``group`` (e.g. the pipeline-parallel group, whose ranks hold disjoint parameters)
    is all-reduced on top, so every rank of it must call this.  The gradients of the
    parameters in ``skip_in_norm`` are scaled but left out of the norm (a weight whose
    gradient another rank of ``group`` already counts).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    skipped = {id(p) for p in skip_in_norm}
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skipped]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if group is not None and dist.get_backend(group) == "nccl" and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())

    def combine(values: list[torch.Tensor]) -> torch.Tensor:
        if not values:
            return torch.zeros((), device=device)
        stacked = torch.stack([v.float().to(device) for v in values])
        return stacked.max() if inf else stacked.sum()

    def local_stat(tensors: list[torch.Tensor]) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(t, norm_type).float() for t in tensors]
        return combine(norms if inf else [n**norm_type for n in norms])

    by_layout: dict[tuple, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for grad in counted:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            by_layout.setdefault((grad.device_mesh, grad.placements), []).append(grad.to_local())
        else:
            plain.append(grad)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    stats = [local_stat(plain)]
    for (mesh, placements), tensors in by_layout.items():
        stat = local_stat(tensors)
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(stat, op=op, group=mesh.get_group(mesh_dim))
        stats.append(stat)
    total = combine(stats)
    if group is not None:
        dist.all_reduce(total, op=op, group=group)
    total = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device))
    return total
