"""Finding what to shard in an unchanged module: attention and MLP regions by child names and shapes, per-head
norms and size attributes to divide; the vocabulary embedding, LM head and tied weights in :mod:`.vocabulary`.

:func:`plan_tensor_parallel` is pure: every refusal is a ``ValueError`` naming the module and the fix, raised
before any collective.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Iterator, Mapping
from typing import Any

import torch.nn as nn

from lightning_4d.tensor_parallel.adapters import adapter_names, check_adapters
from lightning_4d.tensor_parallel.experts import plan_experts
from lightning_4d.tensor_parallel.plan import (
    _SEQUENCE_DIM,
    FusedGateUpLayout,
    FusedQKVLayout,
    GroupedQKVLayout,
    ModuleStyle,
    Region,
    TensorParallelPlan,
    _child,
    _int_attrs,
    _is_conv1d,
    _linear_shape,
    _pattern,
    _under,
)
from lightning_4d.tensor_parallel.multihead import plan_multihead
from lightning_4d.tensor_parallel.size_attributes import _HEAD_ATTRS, _HEAD_DIM_ATTRS, _KV_HEAD_ATTRS, divided, local_sizes
from lightning_4d.tensor_parallel.user_plan import _matches, _parse_user_plan
from lightning_4d.tensor_parallel.vocabulary import check_ties, coverage, plan_vocabulary

# (column-wise children, row-wise child); checked by shapes after matching names.
_ATTENTION_PRESETS = (
    (("q_proj", "k_proj", "v_proj"), "o_proj"),  # Hugging Face Llama/Mistral/Qwen, lightning_4d/demos/gpt.py
    (("q_proj", "k_proj", "v_proj"), "out_proj"),
    (("wq", "wk", "wv"), "wo"),  # Meta / torchtitan Llama
    (("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv"), "wo"),  # torchtitan 0.3 GQAttention, fuse_qkv=False
    (("q", "k", "v"), "o"),  # Hugging Face T5 (and its relatives: mT5, UMT5, LongT5's local attention)
    (("q_proj", "k_proj", "v_proj"), "dense"),  # Hugging Face Phi (-1, -1.5, -2)
    (("q_lin", "k_lin", "v_lin"), "out_lin"),  # Hugging Face XLM, FlauBERT
    (("q_proj", "k_proj", "v_proj"), "Wo"),  # Hugging Face ModernBERT decoder
)
_FUSED_ATTENTION_PRESETS = (
    ("c_attn", "c_proj"),  # GPT-2 (transformers Conv1D), nanoGPT (nn.Linear)
    ("qkv", "proj"),  # litgpt
    ("qkv_proj", "o_proj"),  # Hugging Face Phi-3
    ("Wqkv", "Wo"),  # Hugging Face ModernBERT
)
# Fused q|k|v laid out head by head (head 0's q, k, v, then head 1's, ...): a contiguous column-wise shard
# already holds whole heads, so nothing is permuted.
_INTERLEAVED_ATTENTION_PRESETS = (("query_key_value", "dense"),)  # Hugging Face GPT-NeoX, Bloom (and Falcon-7B's
# multi-query layout under the same names: every q head, then the one k and v head)
# Fused q|k|v one level down, laid out by key/value group (each group's q heads, then its k and v): torchtitan
# 0.3's GQAttention holds a FusedQKVLinear as qkv_linear, which views wqkv's output [groups, q_per_kv + 2, head_dim].
_GROUPED_ATTENTION_PRESETS = (("qkv_linear.wqkv", "wo"),)
_MLP_PRESETS = (
    (("gate_proj", "up_proj"), "down_proj"),  # Hugging Face, lightning_4d/demos/gpt.py (up_proj only)
    (("w1", "w3"), "w2"),  # Meta / torchtitan
    (("c_fc",), "c_proj"),  # GPT-2, nanoGPT
    (("fc_1", "fc_2"), "proj"),  # litgpt LLaMAMLP
    (("fc",), "proj"),  # litgpt GptNeoxMLP
    (("fc1",), "fc2"),
    (("linear1",), "linear2"),  # torch's nn.TransformerEncoderLayer / nn.TransformerDecoderLayer
    (("lin1",), "lin2"),  # Hugging Face XLM, FlauBERT (TransformerFFN)
)
_FUSED_MLP_PRESETS = (("gate_up_proj", "down_proj"), ("Wi", "Wo"))  # Phi-3, ModernBERT: gate|up in one linear
# BERT-style encoder layers (BERT, RoBERTa, XLM-R, ELECTRA, ...): q/k/v one level down in the attention core
# (``attention.self``), the output projection in its sibling (``attention.output.dense``), which also adds the
# residual and normalizes; the MLP split over the layer's ``intermediate`` and ``output`` children likewise.
_SPLIT_ATTENTION_PRESETS = ((("self.query", "self.key", "self.value"), "output.dense"),)
_SPLIT_MLP_PRESETS = ((("intermediate.dense",), "output.dense"),)
# Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): low-rank down-projections and their norms, whole on
# every rank, then per-head up-projections (column-wise) and o_proj (row-wise), as Megatron and vLLM split it.
# (query up-projection, or the full-rank query projection; key/value down-projection; its norm; key/value
# up-projection; output projection)
_LATENT_ATTENTION_PRESETS = ((("q_b_proj", "q_proj"), "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"),)


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
        shapes = {n: linears.get(n) or _nested_linear(module, n) for n in (*qkv, out)}
        if all(shapes.values()):
            (width, q_w), (k_in, k_w), (v_in, v_w) = (shapes[n] for n in qkv)
            o_in, o_out = shapes[out]
            if k_in == v_in == width == o_out and k_w == v_w and o_in == q_w:
                return _attention_region(fqn, module, qkv, out, width, q_w, k_w, None, divide)
    for preset in _LATENT_ATTENTION_PRESETS:
        region = _latent_attention(fqn, module, *preset)
        if region is not None:
            return region
    for qkv, out in _SPLIT_ATTENTION_PRESETS:
        region = _split_attention(fqn, module, qkv, out, divide)
        if region is not None:
            return region
    for fused, out in _FUSED_ATTENTION_PRESETS:
        if fused in linears and out in linears:
            (width, total), (q_w, o_out) = linears[fused], linears[out]
            if getattr(module, "multi_query", None) is False and total == 3 * q_w and o_out == width:
                return _interleaved_region(fqn, module, fused, out, width, q_w, divide)  # GPTBigCode without MQA
            if o_out == width and total > q_w and (total - q_w) % 2 == 0:
                return _attention_region(fqn, module, (fused,), out, width, q_w, (total - q_w) // 2, fused, divide)
    for fused, out in _GROUPED_ATTENTION_PRESETS:
        shape = _nested_linear(module, fused)
        if shape is not None and out in linears:
            (width, total), (q_w, o_out) = shape, linears[out]
            if o_out == width and total > q_w and (total - q_w) % 2 == 0:
                region = _attention_region(fqn, module, (fused,), out, width, q_w, (total - q_w) // 2, fused, divide)
                if region is not None and region.fused is not None and region.heads % region.kv_heads == 0:
                    layout = GroupedQKVLayout(region.heads // region.kv_heads, region.kv_heads, region.head_dim,
                                              region.fused.dim)
                    return replace(region, fused=layout)
    for fused, out in _INTERLEAVED_ATTENTION_PRESETS:
        if fused in linears and out in linears:
            (width, total), (o_in, o_out) = linears[fused], linears[out]
            if total == 3 * o_in and o_out == width:
                return _interleaved_region(fqn, module, fused, out, width, o_in, divide)
            if (getattr(module, "multi_query", None) is True and not getattr(module, "new_decoder_architecture", True)
                    and o_out == width and total > o_in and (total - o_in) % 2 == 0):  # Falcon-7B: q heads | k | v
                return _attention_region(fqn, module, (fused,), out, width, o_in, (total - o_in) // 2, fused, divide)
    for fused, out in _FUSED_MLP_PRESETS:
        if fused in linears and out in linears:
            (width, total), (inner, o_out) = linears[fused], linears[out]
            if total == 2 * inner and o_out == width:
                _head_norms(fqn, module, (fused, out), None)
                layout = FusedGateUpLayout(inner, 1 if _is_conv1d(getattr(module, fused)) else 0)
                return Region("mlp", (fused,), out, width, inner, fused=layout)
    for ins, out in _SPLIT_MLP_PRESETS:
        shapes = [_nested_linear(module, n) for n in (*ins, out)]
        if all(shapes) and all(s == shapes[0] for s in shapes[:-1]) and shapes[-1] == shapes[0][::-1]:
            # Beside the layer's attention (a region of its own): the region is only these linears.
            return Region("mlp", ins, out, *shapes[0], loose=True)
    for ins, out in _MLP_PRESETS:
        present = tuple(n for n in ins if n in linears)
        if present and out in linears:
            width, inner = linears[present[0]]
            if all(linears[n] == (width, inner) for n in present) and linears[out] == (inner, width):
                beside = [name for name, child in module.named_children()
                          if name not in (*present, out) and any(True for _ in child.parameters())]
                if beside:  # e.g. OPT's decoder layer: fc1/fc2 next to self_attn and the norms
                    return Region("mlp", present, out, width, inner, loose=True)
                _head_norms(fqn, module, (*present, out), None)
                return Region("mlp", present, out, width, inner)
    return _generic_mlp(module, linears)


def _latent_attention(fqn: str, module: nn.Module, queries: tuple[str, ...], kv_a: str, kv_norm: str, kv_b: str,
                      out: str) -> Region | None:
    """Multi-head latent attention, read from its sizes (``num_heads``, ``kv_lora_rank``, ``qk_rope_head_dim``,
    ``qk_nope_head_dim``, ``v_head_dim``, on the module or its config). The heads are split after the low-rank
    up-projections; the down-projections and their norms stay whole, fed the whole hidden state (``narrow``
    off). The rotary key columns of ``kv_a`` (one key shared by every head) get their gradient summed over tp:
    each rank's heads read them."""
    q = next((name for name in queries if _nested_linear(module, name)), None)
    shapes = {name: _nested_linear(module, name) for name in (kv_a, kv_b, out)}
    if q is None or not all(shapes.values()):
        return None
    sizes = {}
    for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        value = next(iter({**_int_attrs(getattr(module, "config", None), (name,)),
                           **_int_attrs(module, (name,))}.values()), None)
        if value is None:
            return None
        sizes[name] = value
    heads = next(iter(_int_attrs(module, _HEAD_ATTRS).values()), None) or next(
        iter(_int_attrs(getattr(module, "config", None), _HEAD_ATTRS).values()), None)
    rank, rope, nope, v = (sizes[n] for n in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    (_, q_w), (width, kv_a_w), (kv_b_in, kv_b_w), (o_in, o_out) = _nested_linear(module, q), *shapes.values()
    if (not heads or q_w != heads * (nope + rope) or kv_a_w != rank + rope or kv_b_in != rank
            or kv_b_w != heads * (nope + v) or o_in != heads * v or o_out != width):
        return None
    low_rank = tuple(name for name, child in module.named_children()
                     if name not in (q, kv_b, out) and any(True for _ in child.parameters()))
    return Region("attention", (q, kv_b), out, width, heads * v, heads, heads, nope + rope, narrow=False,
                  low_rank=low_rank, shared_columns=(kv_a, rank))


def _split_attention(fqn: str, module: nn.Module, qkv: tuple[str, ...], out: str,
                     divide: dict[str, list[str]]) -> Region | None:
    """A BERT-style attention: its output projection's holder adds the residual (the hidden state this module
    received, whole) and normalizes, so the module's code must see the hidden state whole (``narrow=False``);
    norms in that holder act on the all-reduced output, identical on every rank, and stay replicated."""
    shapes = [_nested_linear(module, n) for n in (*qkv, out)]
    if not all(shapes):
        return None
    (width, q_w), (k_in, k_w), (v_in, v_w), (o_in, o_out) = shapes
    if not (k_in == v_in == width == o_out and k_w == v_w and o_in == q_w):
        return None
    core = module.get_submodule(qkv[0].rpartition(".")[0])
    geometry = _head_geometry(core, q_w)
    if geometry is None:
        return None
    holder = out.rpartition(".")[0]
    after = tuple(_child(holder, name) for name, child in module.get_submodule(holder).named_children()
                  if _is_norm(child))
    region = _attention_region(fqn, module, qkv, out, width, q_w, k_w, None, divide, geometry, after)
    return replace(region, narrow=False, after=after) if region is not None else None


def _nested_linear(module: nn.Module, name: str) -> tuple[int, int] | None:
    try:
        return _linear_shape(module.get_submodule(name))
    except AttributeError:
        return None


def _interleaved_region(
    fqn: str, module: nn.Module, fused: str, out: str, width: int, q_width: int, divide: dict[str, list[str]]
) -> Region | None:
    region = _attention_region(fqn, module, (fused,), out, width, q_width, q_width, None, divide)
    return replace(region, interleaved=True) if region is not None else None


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
    geometry: tuple[int, int] | None = None,
    after: tuple[str, ...] = (),
) -> Region | None:
    geometry = geometry or _head_geometry(module, q_width)
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
        layout = FusedQKVLayout(heads, kv_heads, head_dim, 1 if _is_conv1d(module.get_submodule(fused)) else 0)
    # A norm over a whole q or k projection's output (OLMo 2): only with separate projections, whose column-wise
    # shards are whole heads in order, as the norm's sharded weight is.
    widths = (q_width, kv_width) if fused is None and len(inputs) == 3 and heads > 1 else ()
    # A relative-position bias per head (T5's nn.Embedding of [buckets, heads]): split with the heads.
    bias = tuple(name for name, child in module.named_children()
                 if isinstance(child, nn.Embedding) and child.embedding_dim == heads and heads > 1)
    whole = _projection_norms(module, (*inputs, out, *after, *bias), head_dim, widths)
    norms = _head_norms(fqn, module, (*inputs, out, *after, *bias), head_dim, whole)
    return Region("attention", inputs, out, width, q_width, heads, kv_heads, head_dim, layout, norms,
                  projection_norms=whole, head_embeddings=bias)


def _is_norm(child: nn.Module) -> bool:
    return "norm" in type(child).__name__.lower() and not list(child.children())


def _projection_norms(module: nn.Module, projections: tuple[str, ...], head_dim: int,
                      widths: tuple[int, ...]) -> tuple[str, ...]:
    """Norms of a region whose parameters are vectors as wide as a q or k projection's output (not per head)."""
    return tuple(
        name for name, child in module.named_modules()
        if name and widths and not _under(name, projections) and _is_norm(child)
        and (params := list(child.parameters(recurse=False)))
        and all(p.dim() == 1 and p.numel() in widths and p.numel() != head_dim for p in params)
    )


def _head_norms(fqn: str, module: nn.Module, projections: tuple[str, ...], head_dim: int | None,
                projection_norms: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Per-head norms inside a region (their grads get summed over tp); any other parameter is an error, except
    the ``projection_norms`` over whole projections, sharded with them."""
    norms = []
    for name, child in module.named_modules():
        params = list(child.parameters(recurse=False))
        if not params or (name and _under(name, projections)) or name in projection_norms:
            continue
        if name and "norm" in type(child).__name__.lower() and head_dim and all(p.numel() == head_dim for p in params):
            norms.append(name)
            continue
        why = ("that are neither its projections nor a per-head norm of size head_dim; tensor parallelism cannot"
               " tell how to shard them")
        if not name:  # the module's own parameters (attention sinks, differential attention's lambdas)
            what = "its own parameters " + ", ".join(f"{n} {list(p.shape)}" for n, p in
                                                      child.named_parameters(recurse=False))
        elif _linear_shape(child) is not None:  # e.g. Zamba2's low-rank adapters beside gate_up_proj
            what = (f"a linear {_child(fqn, name)} ({_linear_shape(child)[0]}->{_linear_shape(child)[1]}) beside its"
                    f" projections {', '.join(projections)}")
            why = ("(a branch its own code combines with theirs: a low-rank adapter, a gate, a second query); the"
                   " automatic plan cannot tell how to split it with them")
        else:
            what = f"parameters in {_child(fqn, name)} ({type(child).__name__})"
        raise ValueError(
            f"{fqn} ({type(module).__name__}) has {what} {why}. Fix: keep it unsharded with tp_plan:"
            f" {{'{_pattern(fqn)}': replicate}}."
        )
    return tuple(norms)


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
    user_styles, replicated, divide, sources = _parse_user_plan(user, modules, sequence_parallel)
    plan = TensorParallelPlan(tp_size, replicated=tuple(replicated), sequence_parallel=sequence_parallel)
    if tp_size == 1:
        return plan

    plan_multihead(plan, modules, replicated)  # torch's nn.MultiheadAttention: fused in_proj by heads
    for fqn, region in _regions(modules, replicated, divide):
        m = modules[fqn]
        if not region.narrow and sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True: {fqn} ({type(m).__name__}) adds the hidden state it receives to its output"
                f" projection's result inside {region.output.rpartition('.')[0]} (a BERT-style residual), which"
                " sequence parallelism would hand it sequence-sharded. Use sequence_parallel=False (tensor"
                " parallelism still shards its heads and MLP).")
        if region.loose and sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True: {fqn} ({type(m).__name__}) holds its MLP's linears {region.inputs[0]} and"
                f" {region.output} beside its other modules, so there is no MLP module whose input sequence"
                " parallelism could gather. Use sequence_parallel=False (tensor parallelism still shards the MLP).")
        if (region.kind == "attention" and region.heads is not None and region.kv_heads and region.kv_heads < tp_size
                and tp_size % region.kv_heads == 0 and region.heads % tp_size == 0):
            region = replace(region, kv_replicated=True)  # fused: FusedQKVLayout gives each rank its k/v head
        _check_region(fqn, m, region, tp_size)
        plan.regions[fqn] = region
        for name in region.inputs:
            if name not in region.replicated_kv_projections:
                plan.styles[_child(fqn, name)] = ModuleStyle("colwise", role=region.kind)
        rowwise_output = f"shard({_SEQUENCE_DIM})" if sequence_parallel else None
        plan.styles[_child(fqn, region.output)] = ModuleStyle("rowwise", output=rowwise_output, role=region.kind)
        for name in region.projection_norms:
            plan.styles[_child(fqn, name)] = ModuleStyle("sharded_norm", role=region.kind)
        for name in region.head_embeddings:  # [buckets, heads]: column-wise gives each rank its heads' biases
            plan.styles[_child(fqn, name)] = ModuleStyle("colwise", role=region.kind)
        if region.kind == "attention" and fqn not in divide:
            attrs = local_sizes(fqn, m, region, tp_size)
            config = getattr(m, "config", None)
            config_attrs = local_sizes(f"{fqn}.config", config, region, tp_size) if config is not None else {}
            if attrs:
                plan.attributes[fqn] = attrs
            if config_attrs:
                plan.config_attributes[fqn] = config_attrs
            for holder in region.holders:  # a module between the attention and its projection (qkv_linear)
                held = local_sizes(_child(fqn, holder), m.get_submodule(holder), region, tp_size)
                if held:
                    plan.attributes[_child(fqn, holder)] = held
    for fqn, names in divide.items():
        attrs = _int_attrs(modules[fqn], names)
        missing = [n for n in names if n not in attrs]
        if missing:
            raise ValueError(
                f"tp_plan entry for {fqn}: 'divide' names {missing}, which are not integer attributes of it."
            )
        plan.attributes[fqn] = divided(fqn, attrs, tp_size)

    plan_experts(plan, module, replicated, sequence_parallel)  # fused 3-D MoE experts (tensor_parallel/experts.py)
    plan_vocabulary(plan, modules, replicated, sequence_parallel, loss_parallel)
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
        suggestion = _suggested_plan(module, modules, tp_size, user, replicated, sequence_parallel)
        if suggestion:
            entries = "".join(f'\n    "{key}": {style}' for key, style in suggestion.items())
            fix = f"Fix: name the pairs to shard in tp_plan, e.g. in YAML:\n  tp_plan:{entries}\n"
        else:
            fix = (
                "Fix: name in tp_plan a linear to shard column-wise and the linear that reads its output (after "
                "elementwise code only) to shard row-wise, e.g. in YAML:\n"
                '  tp_plan:\n    "<first linear>": colwise\n    "<second linear>": rowwise\n'
            )
        raise ValueError(
            f"tp={tp_size} but nothing in {type(module).__name__} can be sharded automatically: no attention "
            "(q/k/v -> output projection), MLP (up/gate -> down) or vocabulary embedding was recognised. "
            f"Linear modules found:\n  {listing}\n{fix}or use tp=1."
        )
    for fqn, style in user_styles.items():
        auto = plan.styles.get(fqn)
        if auto is not None and auto.style == style.style:  # keep the automatic layouts and role the user left out
            style = ModuleStyle(style.style, style.input or auto.input, style.output or auto.output, auto.role)
        plan.styles[fqn] = style
    head = [s for s in plan.styles.values() if s.role == "head"]
    plan.loss_parallel = loss_parallel and bool(head) and head[0].output is None
    for fqn, style in plan.styles.items():
        owner, _, leaf = fqn.rpartition(".")
        if leaf == "base_layer" and adapter_names(modules.get(owner)):  # peft's Embedding: its table planned alone
            plan.adapters[owner] = adapter_names(modules[owner])
        elif style.style in ("colwise", "rowwise") and adapter_names(modules[fqn]):
            check_adapters(fqn, modules[fqn], _pattern(fqn))
            plan.adapters[fqn] = adapter_names(modules[fqn])
    check_ties(plan, module)
    plan.coverage = coverage(plan, modules)
    planned = {*plan.styles, *plan.regions, *plan.attributes, *plan.config_attributes}
    plan.classes = {fqn: type(modules[fqn]).__name__ for fqn in planned}
    plan.sources = {fqn: key for fqn, key in sources.items() if plan.styles[fqn].role == "user"}
    return plan


def _regions(
    modules: dict[str, nn.Module], replicated: list[str], divide: dict[str, list[str]]
) -> Iterator[tuple[str, Region]]:
    """The attention and MLP regions in module order, outermost first, none inside another or a replicated one."""
    found: list[str] = []
    for fqn, m in modules.items():
        if _under(fqn, replicated) or _under(fqn, found):
            continue
        region = _find_region(fqn, m, divide)
        if region is None or any(_under(_child(fqn, n), replicated) for n in (*region.inputs, region.output)):
            continue
        if not region.loose:  # a loose MLP's neighbours (the layer's attention) are regions of their own
            found.append(fqn)
        yield fqn, region


def find_regions(module: nn.Module) -> dict[str, Region]:
    """The attention and MLP regions the automatic plan finds, by FQN, with their sizes (heads, key/value
    heads, widths), for any tp: pure and size-only, so it works on a module built on the meta device. The
    planner reads a model's head counts from here, so that it counts them as the runtime does."""
    return dict(_regions(dict(module.named_modules()), [], {}))


def _suggested_plan(
    module: nn.Module,
    modules: dict[str, nn.Module],
    tp: int,
    user: Mapping[str, Any],
    replicated: list[str],
    sequence_parallel: bool,
) -> dict[str, str]:
    """A tp_plan in the module's own names for a module with nothing recognised: pairs of linears of one
    parent, next to each other in registration order, the first's output width the second's input width and
    divisible by tp; pairs that go back to their input width (C->F->C) first. Returned only if it plans."""
    linears = [(f, _linear_shape(m)) for f, m in modules.items() if _linear_shape(m) and not _under(f, replicated)]
    pairs = [
        ((a, sa), (b, sb))
        for (a, sa), (b, sb) in zip(linears, linears[1:])
        if a.rpartition(".")[0] == b.rpartition(".")[0] and sa[1] == sb[0] and sa[1] % tp == 0
    ]
    pairs.sort(key=lambda pair: pair[0][1][0] != pair[1][1][1])  # stable: C->F->C pairs first, in module order
    styles: dict[str, str] = {}
    for (a, _), (b, _) in pairs:
        if a not in styles and b not in styles:
            styles.update({a: "colwise", b: "rowwise"})
    suggestion: dict[str, str] = {}
    for fqn, style in styles.items():  # one glob for a repeated block's modules when it names only them
        glob = _pattern(fqn)
        alike = all(styles.get(other) == style for other in modules if _matches(glob, other))
        suggestion[glob if alike else fqn] = style
    if not suggestion:
        return {}
    try:
        plan_tensor_parallel(module, tp, {**user, **suggestion}, sequence_parallel=sequence_parallel)
    except ValueError:
        return {}
    return suggestion


def _check_region(fqn: str, module: nn.Module, region: Region, tp: int) -> None:
    kind = type(module).__name__
    if region.kind == "attention" and region.heads is not None:
        if region.kv_heads and region.kv_heads % tp and not region.kv_replicated and region.heads % tp == 0:
            kv = region.kv_heads
            raise ValueError(f"{fqn} ({kind}) has {kv} key/value heads, not divisible by tp={tp}, and tp={tp} is no"
                             f" multiple of {kv}. Fix: choose a tensor-parallel size that divides {kv}, or a multiple"
                             f" of {kv} (k and v then stay whole on every rank), or keep the attention unsharded with"
                             f" tp_plan: {{'{_pattern(fqn)}': replicate}}.")
        kv_width = region.kv_heads * region.head_dim if region.kv_heads else None
        for name in region.projection_norms if region.kv_replicated and kv_width != region.inner else ():
            if any(p.numel() == kv_width for p in module.get_submodule(name).parameters()):
                raise ValueError(
                    f"{_child(fqn, name)} ({type(module.get_submodule(name)).__name__}) normalizes the whole key"
                    f" projection ({kv_width} features), but {fqn} ({kind}) has {region.kv_heads} key/value heads,"
                    f" fewer than tp={tp}: each rank keeps only its key/value head's features, so the norm cannot"
                    f" see the whole width. Fix: a tensor-parallel size that divides {region.kv_heads}, or keep"
                    f" the attention unsharded with tp_plan: {{'{_pattern(fqn)}': replicate}}.")
        for what, count in (("attention heads", region.heads),):
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


