"""Expert-parallel sizes and the models it can split, checked before any collective (pure functions)."""

from __future__ import annotations

from torch import nn

from lightning_4d.experts import find_fused_experts
from lightning_4d.parallel_dims import check_ep_layout, check_ep_size

__all__ = ["check_ep_layout", "check_ep_model", "check_ep_size"]


def check_ep_model(module: nn.Module, ep: int) -> None:
    """Refuse a module whose experts ``ep`` cannot split: none found, a count ep does not divide, or a form whose
    routing cannot be reached (a hand-written ``nn.ModuleList`` of experts called in the module's own loop)."""
    fused = find_fused_experts(module)
    lists = [fqn for fqn, m in module.named_modules()
             if isinstance(m, nn.ModuleList) and fqn.rpartition(".")[2] == "experts" and len(m) > 1]
    if not fused:
        if lists:
            raise ValueError(
                f"ep={ep}: {lists[0]} is an nn.ModuleList of experts that {type(module).__name__}'s own loop calls one"
                " by one, so lightning_4d cannot send the tokens to the rank holding their expert. Fix: store the"
                " experts as fused 3-D parameters gate_up_proj [E, 2*I, H] and down_proj [E, H, I] called as"
                " experts(hidden, top_k_index, top_k_weights) (Hugging Face transformers' form), or use tp to shard"
                " the experts' intermediate size, or ep=1.")
        raise ValueError(f"ep={ep}, but {type(module).__name__} has no mixture-of-experts layer: no module holds fused"
                         " 3-D experts (gate_up_proj [E, 2*I, H], down_proj [E, H, I]). Use ep=1.")
    for fqn, found in fused.items():
        if found.experts % ep:
            raise ValueError(f"ep={ep} does not divide the {found.experts} experts of {fqn} ({found.cls}): each rank"
                             f" must hold the same number of whole experts. Use an ep that divides {found.experts}.")
