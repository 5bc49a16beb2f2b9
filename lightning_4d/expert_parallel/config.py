"""Expert-parallel sizes and the models it can split, checked before any collective (pure functions)."""

from __future__ import annotations

from torch import nn

from lightning_4d.modules.experts import (ROUTER_NAMES, TOP_K_NAMES, check_expert_list, find_expert_lists,
                                  find_fused_experts)
from lightning_4d.parallel_dims import check_ep_layout, check_ep_size

__all__ = ["check_ep_layout", "check_ep_model", "check_ep_size"]


def check_ep_model(module: nn.Module, ep: int, tp: int = 1) -> None:
    """Refuse a module whose experts ``ep`` cannot split: none found, a count ep does not divide, or a hand-written
    MoE whose routing cannot be reached (its forward is not the common softmax -> top-k -> weighted sum of its
    ``nn.ModuleList`` experts, checked on a probe batch here, without communicating)."""
    fused = find_fused_experts(module)
    lists = find_expert_lists(module)
    counts = {fqn: (found.experts, found.cls) for fqn, found in {**fused, **lists}.items()}
    for fqn, found in lists.items():
        if check_expert_list(module.get_submodule(fqn), found) is None:
            raise ValueError(
                f"ep={ep}: the routing of {fqn} ({found.cls}) cannot be reached: its forward does not compute what"
                f" softmax({found.router}(x)) -> top-{found.top_k} -> (renormalized) weighted sum of its experts'"
                " outputs computes on a probe batch, so lightning_4d cannot send the tokens to the rank holding"
                " their expert. Fix: write the MoE's forward in that form (or as Hugging Face's fused experts"
                " called as experts(hidden, top_k_index, top_k_weights)), or use tp, or ep=1.")
    others = [fqn for fqn, m in module.named_modules() if isinstance(m, nn.ModuleList)
              and fqn.rpartition(".")[2] == "experts" and len(m) > 1 and fqn.rpartition(".")[0] not in lists]
    if not counts:
        if others:
            raise ValueError(
                f"ep={ep}: {others[0]} is an nn.ModuleList of experts, but its module has no linear router child"
                f" (one of {', '.join(ROUTER_NAMES)}) scoring each expert and no integer top-k attribute (one of"
                f" {', '.join(TOP_K_NAMES)}), or its experts differ in shape, so lightning_4d cannot route its"
                " tokens. Fix: name the router and top-k so, or store the experts as Hugging Face's fused 3-D"
                " parameters, or use tp, or ep=1.")
        raise ValueError(f"ep={ep}, but {type(module).__name__} has no mixture-of-experts layer: no fused 3-D experts"
                         " (gate_up_proj [E, 2*I, H], down_proj [E, H, I]) and no nn.ModuleList of experts with a"
                         " router. Use ep=1.")
    for fqn, (experts, cls) in counts.items():
        if experts % ep:
            raise ValueError(f"ep={ep} does not divide the {experts} experts of {fqn} ({cls}): each rank"
                             f" must hold the same number of whole experts. Use an ep that divides {experts}.")
