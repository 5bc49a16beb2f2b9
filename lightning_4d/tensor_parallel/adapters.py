"""LoRA adapters (peft's ``get_peft_model``) under tensor parallelism.

A peft-wrapped linear is planned as its base layer, and each adapter follows the base layer's sharding, so that
its forward adds no collective: under a column-wise base, ``lora_B`` is sharded column-wise with it and
``lora_A`` stays whole (its output is the whole low-rank activation every rank already has the input for);
under a row-wise base, ``lora_A`` is sharded row-wise with it (a partial low-rank activation) and ``lora_B``
stays whole, so its output is a partial sum that joins the base layer's one all-reduce. The whole factor's
gradient is summed over tp in backward (each rank saw its part only), as for any replicated weight.

Wrappers are recognised by their structure (a ``base_layer`` module and ``lora_A``/``lora_B`` module dicts), so
peft is no dependency of lightning_4d.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

# (lora_A's, lora_B's) placements of an adapter on a base layer sharded column-wise or row-wise.
_FACTORS = {
    "colwise": ({"weight": Replicate()}, {"weight": Shard(0), "bias": Shard(0)}),
    "rowwise": ({"weight": Shard(1)}, {"weight": Replicate(), "bias": Replicate()}),
}


def adapter_names(module: nn.Module) -> tuple[str, ...]:
    """The LoRA adapters of a peft-wrapped layer (``()`` for any other module); an embedding's are tables in
    ``lora_embedding_A``."""
    factors = [getattr(module, name, None) for name in ("lora_A", "lora_B")]
    if not isinstance(getattr(module, "base_layer", None), nn.Module) or \
            not all(isinstance(f, nn.ModuleDict) for f in factors):
        return ()
    tables = getattr(module, "lora_embedding_A", None)
    return tuple(factors[0].keys()) + (tuple(tables.keys()) if isinstance(tables, nn.ParameterDict) else ())


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a peft wrapper adapts (the module itself if it is none)."""
    while adapter_names(module):
        module = module.base_layer
    return module


def check_adapters(fqn: str, module: nn.Module, pattern: str) -> None:
    """Refuse, before any collective, an adapted layer holding parameters other than its base layer's and its
    adapters' ``lora_A``/``lora_B`` linears (DoRA's magnitude, a nested wrapper): no placement is known for them."""
    names = adapter_names(module)
    known = {f"base_layer.{n}" for n, _ in module.base_layer.named_parameters()}
    if not adapter_names(module.base_layer):
        for name in names:
            for factor in ("lora_A", "lora_B"):
                layer = getattr(module, factor)[name]
                if isinstance(layer, nn.Linear):
                    known |= {f"{factor}.{name}.{n}" for n, _ in layer.named_parameters()}
    unknown = [n for n, _ in module.named_parameters() if n not in known]
    if unknown:
        raise ValueError(
            f"{fqn} ({type(module).__name__}) is an adapted layer with parameters {unknown[:4]} that are not plain"
            " LoRA factors (lora_A and lora_B linears around one base layer: DoRA, a nested adapter or another"
            " variant), so tensor parallelism cannot tell how to shard them. Fix: keep it unsharded with tp_plan:"
            f" {{'{pattern}': replicate}}, use plain LoRA on it, or use tp=1.")


def adapter_placements(module: nn.Module, style: str, base: dict[str, Placement]) -> dict[str, Placement]:
    """Placements of every parameter of a peft-wrapped layer, by name relative to it: ``base`` for its base
    layer's, and its adapters' following them (see the module docstring)."""
    placements = {f"base_layer.{name}": placement for name, placement in base.items()}
    factor_a, factor_b = _FACTORS[style]
    for name in adapter_names(module):
        placements.update({f"lora_A.{name}.{n}": p for n, p in factor_a.items()})
        placements.update({f"lora_B.{name}.{n}": p for n, p in factor_b.items()})
    return placements


def describe_factors(style: str) -> str:
    """How the adapters on a base layer sharded ``style``-wise are placed, for the plan printout."""
    if style == "colwise":
        return "lora_B colwise with the base layer, lora_A whole on every rank (gradient summed over tp)"
    if style == "whole":  # beside a base layer planned on its own (an embedding), whose output every rank has whole
        return "whole on every rank beside the sharded base layer, added to its whole output"
    return ("lora_A rowwise with the base layer, lora_B whole on every rank (its partial output joins the base"
            " layer's all-reduce; gradient summed over tp)")


def row_holders(module: nn.Module, layout: Any) -> list[tuple[nn.Module, Any]]:
    """The modules whose output rows are a fused projection's (q|k|v, gate|up), each with the layout of its
    weight: the base layer, and each adapter's ``lora_B`` (an nn.Linear: rows on dim 0), whose rows must be
    permuted the same way."""
    holders = [(base_layer(module), layout)]
    for name in adapter_names(module):
        holders.append((module.lora_B[name], replace(layout, dim=0)))
    return holders
