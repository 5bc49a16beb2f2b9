"""Expert parallelism in the planner: a mixture-of-experts model's routed-expert parameters, what each rank holds
under ``ep`` (and ``tp``, ``dp_shard``), its model state per rank, and the expert-parallel traffic per step.

Arithmetic only. Reading a module's sizes (:meth:`MoESizes.from_module`, which works on the meta device) imports
torch; the estimate does not.

* model state per rank: the experts split over ``ep x tp`` (whole experts over ep, each expert's intermediate
  size over tp); the rest of the model split over ``tp x dp_shard`` (an upper bound where tp leaves norms
  whole), times the bytes per parameter of the precision and optimizer (:data:`~.estimate.PRECISIONS`,
  :data:`~.estimate.OPTIMIZER_STATES`), as :mod:`lightning_4d.expert_parallel` holds them.
* expert-parallel traffic per rank per step (``ep_bytes``), counted on the sender's side as the dispatchers
  of :mod:`lightning_4d.expert_parallel.dispatch` count it, per MoE layer for ``T`` tokens on the rank:

  - gathered (fused experts, the default): the rank's tokens to each of the ``ep - 1`` others and their partial
    sums back, and both gradients the other way: ``4 x (ep - 1) x T x hidden`` activation elements, plus the
    routing (``top_k`` int64 ids and weights per token) and its weights' gradients;
  - all-to-all (hand-written experts): each token goes to ``top_k`` experts, of which ``(ep - 1) / ep`` live on
    other ranks when routing is balanced: ``4 x (ep - 1) / ep x top_k x T x hidden`` elements plus the counts
    exchange. Unbalanced routing sends more to the busiest experts: the balanced-routing figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_4d.planner.estimate import OPTIMIZER_STATES, PRECISIONS
from lightning_4d.planner.model_sizes import PlanError, check_positive

COUNT_BYTES = 8  # an int64: a routing id (gathered) or a count (all-to-all)


@dataclass(frozen=True)
class MoESizes:
    """A mixture-of-experts model's sizes: ``layers`` MoE layers of ``experts`` experts (hidden ``hidden``,
    intermediate ``inner``), ``top_k`` experts per token; parameter counts of the routed experts and the rest."""

    layers: int
    experts: int
    hidden: int
    inner: int
    top_k: int
    expert_params: int
    dense_params: int
    gathered: bool = True  # dispatched by gathering (fused experts grouped_mm computes), else by all-to-all

    @classmethod
    def from_module(cls, module: Any, top_k: Optional[int] = None) -> MoESizes:
        """Sizes read from a module (whole-built or on the meta device) by the runtime's own discovery; ``top_k``
        when the module does not say (a hand-written MoE's ``top_k``, a transformers config's
        ``num_experts_per_tok``)."""
        from lightning_4d.modules.experts import find_expert_lists, find_fused_experts, grouped_reproduces

        fused, lists = find_fused_experts(module), find_expert_lists(module)
        if not fused and not lists:
            raise PlanError(f"{type(module).__name__} has no mixture-of-experts layer the runtime finds (fused 3-D"
                            " experts, or an nn.ModuleList of experts with a router).")
        found: list[tuple[int, int, int, Optional[int]]] = []  # experts, hidden, inner, top_k per layer
        expert_params = 0
        for fqn, sizes in fused.items():
            config = getattr(module.get_submodule(fqn), "config", None)
            found.append((sizes.experts, sizes.hidden, sizes.inner, getattr(config, "num_experts_per_tok", None)))
            expert_params += sizes.numel
        for fqn, sizes in lists.items():
            moe = module.get_submodule(fqn)
            params = sum(p.numel() for p in moe.experts.parameters())
            router = getattr(moe, sizes.router)
            found.append((sizes.experts, router.in_features, params // (3 * sizes.experts * router.in_features),
                          sizes.top_k))
            expert_params += params
        shapes = {shape[:3] for shape in found}
        if len(shapes) != 1:
            raise PlanError(f"the MoE layers of {type(module).__name__} differ in size ({sorted(shapes)}): the planner"
                            " models alike layers.")
        experts, hidden, inner = shapes.pop()
        top_k = top_k or next((k for *_, k in found if k), None)
        if top_k is None:
            raise PlanError("top_k: the module does not say how many experts each token goes to; pass top_k=.")
        total = sum(p.numel() for p in module.parameters())
        gathered = not lists and all(grouped_reproduces(module.get_submodule(fqn), sizes) for fqn, sizes in fused.items())
        return cls(len(found), experts, hidden, inner, top_k, expert_params, total - expert_params, gathered)


def expert_estimate(sizes: MoESizes, ep: int, tokens_per_rank: int, tp: int = 1, dp_shard: int = 1,
                    precision: str = "32-true", optimizer: str = "adamw", pp: int = 1) -> dict[str, float]:
    """Per rank: parameters (experts, the rest), model-state bytes, and expert-parallel bytes sent per step for
    ``tokens_per_rank`` tokens per step (the rank's samples x sequence length / cp); ``pp`` stages each hold
    (about) 1/pp of the layers and of the rest."""
    for name, value in (("ep", ep), ("tp", tp), ("dp_shard", dp_shard), ("tokens_per_rank", tokens_per_rank),
                        ("pp", pp)):
        check_positive(name, value)
    if sizes.experts % ep:
        raise PlanError(f"ep={ep} does not divide the {sizes.experts} experts per layer.")
    if precision not in PRECISIONS or optimizer not in OPTIMIZER_STATES:
        raise PlanError(f"precision={precision!r} / optimizer={optimizer!r}: use one of {', '.join(PRECISIONS)} and"
                        f" one of {', '.join(OPTIMIZER_STATES)}.")
    pbytes, gbytes, e = PRECISIONS[precision]
    per_param = pbytes + gbytes + OPTIMIZER_STATES[optimizer] * pbytes
    experts = sizes.expert_params / (ep * tp * pp)
    dense = sizes.dense_params / (tp * dp_shard * pp)
    if sizes.gathered:
        states = 4 * (ep - 1) * tokens_per_rank * sizes.hidden * e
        routing = (ep - 1) * tokens_per_rank * sizes.top_k * (COUNT_BYTES + 2 * e)  # ids, weights, their gradients
    else:
        states = 4 * (ep - 1) / ep * sizes.top_k * tokens_per_rank * sizes.hidden * e
        routing = (ep - 1) * (sizes.experts // ep) * COUNT_BYTES  # the counts, forward only: the backward reuses them
    return {"expert_params": experts, "dense_params": dense, "model_state_bytes": (experts + dense) * per_param,
            "ep_bytes": sizes.layers / pp * (states + routing)}


def sizes_from_args(layers: int, hidden: int, experts: int, inner: int, top_k: int, dense_params: int) -> MoESizes:
    """An MoE described on the command line: ``layers`` MoE layers of ``experts`` gated experts (hidden, inner),
    beside ``dense_params`` other parameters (the dense model the size options describe)."""
    for name, value in (("--experts", experts), ("--expert-ffn", inner), ("--top-k", top_k), ("--layers", layers)):
        check_positive(name, value)
    if top_k > experts:
        raise PlanError(f"--top-k {top_k} is more than --experts {experts}: each token goes to top_k of the experts.")
    return MoESizes(layers, experts, hidden, inner, top_k, 3 * layers * experts * hidden * inner, dense_params)


def rank_expert_layouts(sizes: MoESizes, layouts: list[Any], seq_len: int, global_batch: int,
                        precision: str = "32-true", optimizer: str = "adamw",
                        eps: Optional[list[int]] = None) -> list[dict[str, Any]]:
    """Every (layout, ep) pair ``FourDStrategy`` accepts (ep divides the experts and the layout's ``dp x cp``,
    from which it borrows its ranks), with :func:`expert_estimate`'s figures per rank, ranked by model state per
    rank, then expert-parallel bytes per step. ``eps``: only these ep sizes (default: every one that fits)."""
    ranked = []
    for layout in layouts:
        borrowed = layout.data_parallel * layout.cp
        tokens = global_batch // layout.data_parallel * seq_len // layout.cp
        for ep in eps or range(1, borrowed + 1):
            if borrowed % ep or sizes.experts % ep or tokens < 1:
                continue
            figures = expert_estimate(sizes, ep, tokens, tp=layout.tp, dp_shard=layout.dp_shard,
                                      precision=precision, optimizer=optimizer, pp=layout.pp)
            ranked.append({"layout": layout, "ep": ep, **figures})
    if not ranked:
        asked = f"ep in {eps}" if eps else "an ep"
        raise PlanError(f"no layout takes {asked}: ep must divide the {sizes.experts} experts per layer and the"
                        " layout's dp x cp (it borrows those ranks, never tp or pp).")
    return sorted(ranked, key=lambda row: (row["model_state_bytes"], row["ep_bytes"], str(row["layout"])))
