"""The integer attributes an attention (or its config) keeps its global sizes in, and this rank's values of them
under tensor parallelism: head counts and widths divided by tp, key/value heads kept whole when replicated."""

from __future__ import annotations

from typing import Any

from lightning_4d.tensor_parallel.plan import Region, _int_attrs, _pattern

_HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KV_HEAD_ATTRS = ("n_kv_heads", "n_kv_head", "num_key_value_heads", "num_kv_heads", "n_query_groups",
                  "kv_heads")  # kv_heads: GPTBigCode's attention (declared there even when its config says otherwise)
_WIDTH_ATTRS = ("n_embd", "embed_dim", "hidden_size", "all_head_size", "split_size", "d_model", "dim", "inner_dim")
_MODEL_WIDTH_ATTRS = ("n_embd", "embed_dim", "hidden_size", "d_model", "dim")
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size")
_KV_GROUP_ATTRS = ("num_key_value_groups", "n_rep", "num_queries_per_kv", "heads_per_kv")  # q heads per kv head
_GROUP_ROWS_ATTRS = ("r_dim",)  # heads per group of a grouped fused projection: its q heads, k and v (torchtitan)


def size_attributes(source: Any, region: Region) -> dict[str, int]:
    """Integer attributes holding this attention's global head counts or widths."""
    attrs = {n: v for n, v in _int_attrs(source, _HEAD_ATTRS).items() if v == region.heads}
    attrs.update({n: v for n, v in _int_attrs(source, _KV_HEAD_ATTRS).items() if v == region.kv_heads})
    # An attention that sees the hidden state whole (narrow off: BERT-style, MLA) keeps the model's width whole;
    # only its own width (all_head_size, inner_dim) is divided.
    widths = [n for n in _WIDTH_ATTRS if region.narrow or n not in _MODEL_WIDTH_ATTRS]
    attrs.update({n: v for n, v in _int_attrs(source, widths).items() if v in (region.width, region.inner)})
    return attrs


def local_sizes(fqn: str, source: Any, region: Region, tp: int) -> dict[str, int]:
    """This rank's values of the size attributes of an attention (or of its config): divided by tp, except
    that with key/value heads replicated each rank uses one of them, read by all its query heads."""
    attrs = size_attributes(source, region)
    if not region.kv_replicated:
        return divided(fqn, attrs, tp)
    kv = {name: 1 for name, value in _int_attrs(source, _KV_HEAD_ATTRS).items() if value == region.kv_heads}
    groups = {name: region.heads // tp for name, value in _int_attrs(source, _KV_GROUP_ATTRS).items()
              if value == region.heads // region.kv_heads}
    groups.update({name: region.heads // tp + 2 for name, value in _int_attrs(source, _GROUP_ROWS_ATTRS).items()
                   if value == region.heads // region.kv_heads + 2})
    return {**divided(fqn, {n: v for n, v in attrs.items() if n not in kv}, tp), **kv, **groups}


def divided(fqn: str, attrs: dict[str, int], tp: int) -> dict[str, int]:
    """``attrs`` divided by ``tp``; a value that does not divide is a ValueError naming the attribute and the fix."""
    for name, value in attrs.items():
        if value % tp:
            raise ValueError(
                f"{fqn}.{name} = {value} is not divisible by tp={tp}. Fix: choose a tensor-parallel size that "
                f"divides it, or keep the module unsharded with tp_plan: "
                f"{{'{_pattern(fqn.removesuffix('.config'))}': replicate}}."
            )
    return {name: value // tp for name, value in attrs.items()}
