"""Mixture-of-experts layers as tensor and expert parallelism both see them (a shared module).

Hugging Face transformers 5.x stores a layer's routed experts as one module holding fused 3-D parameters,
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], called by its block as ``experts(hidden [T, H],
top_k_index [T, k], top_k_weights [T, k])`` after the router chose; the module's own code (its
``experts_implementation``: eager, batched_mm, grouped_mm) computes each token's weighted sum over its experts.
:func:`find_fused_experts` finds such modules by their parameters' shapes.

:class:`ExpertsForward` replaces such a module's forward once, and both dimensions set their part on it:
tensor parallelism (``tp_group``: each rank holds every expert's slice of the intermediate dimension, the
output is summed over tp once, after the combine), expert parallelism (``dispatch``: each rank holds E/ep whole
experts; tokens travel to them and back). The experts' arithmetic stays the module's own: its original forward
runs on a view of the module whose weights are this rank's local tensors, or, where expert parallelism gathers
the tokens, :func:`grouped_experts` runs it as grouped matmuls once :func:`grouped_reproduces` showed on a probe
that it computes the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.distributed.tensor import DTensor

FUSED_NAMES = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class FusedExperts:
    """Sizes of one fused-experts module: ``experts`` E, ``hidden`` H, ``inner`` I."""

    fqn: str
    cls: str
    experts: int
    hidden: int
    inner: int

    @property
    def numel(self) -> int:
        return 3 * self.experts * self.hidden * self.inner


def _full_shape(param: Any) -> tuple[int, ...]:
    return tuple(param.shape)


def find_fused_experts(module: nn.Module) -> dict[str, FusedExperts]:
    """Every module holding fused 3-D experts ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (weights
    not transposed, no biases), by FQN; pure and shape-only (works on the meta device)."""
    found = {}
    for fqn, m in module.named_modules():
        params = dict(m.named_parameters(recurse=False))
        gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
        if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
            continue
        experts, double, hidden = _full_shape(gate_up)
        if getattr(m, "is_transposed", False) or getattr(m, "has_bias", False) or not getattr(m, "has_gate", True):
            continue
        if double % 2 or _full_shape(down) != (experts, hidden, double // 2):
            continue
        found[fqn] = FusedExperts(fqn, type(m).__name__, experts, hidden, double // 2)
    return found


class _View:
    """The experts module as its original forward sees it, with this rank's local weights and expert count."""

    def __init__(self, module: nn.Module, **overrides: Any) -> None:
        self.__dict__.update(overrides)
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group``: an input every tp rank reads whole, each
    rank's slice of the experts adding its part of the input's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOver(torch.autograd.Function):
    """Forward sums the per-rank partial outputs over ``group``; backward passes the (replicated) gradient on."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def local(param: Tensor) -> Tensor:
    """This rank's part of a parameter, differentiable (a DTensor's local shard)."""
    return param.to_local() if isinstance(param, DTensor) else param


# (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]: the weighted sum of each token's experts,
# wherever they live (expert parallelism's dispatch, bound to this module's ``compute`` or ``grouped``).
Dispatch = Callable[[Tensor, Tensor, Tensor], Tensor]


class ExpertsForward:
    """The forward of a fused-experts module under tensor and/or expert parallelism (see the module docstring).

    ``tp_group``: set by tensor parallelism (the weights are sharded on the intermediate dimension).
    ``dispatch`` and ``first_expert``/``local_experts``: set by expert parallelism. ``grad_scale``: a factor on
    the local weights' gradients (expert parallelism's, see :mod:`lightning_4d.expert_parallel`).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.original = type(module).forward
        self.tp_group: Optional[dist.ProcessGroup] = None
        self.dispatch: Optional[Dispatch] = None
        self.local_experts: int = int(module.gate_up_proj.shape[0])
        self.grad_scale = 1.0

    @classmethod
    def of(cls, module: nn.Module) -> ExpertsForward:
        """The module's :class:`ExpertsForward`, installed on first request."""
        current = module.__dict__.get("forward")
        if isinstance(current, cls):
            return current
        installed = cls(module)
        module.forward = installed
        return installed

    def weights(self) -> dict[str, Tensor]:
        found = {}
        for name in FUSED_NAMES:
            value = local(getattr(self.module, name))
            if self.grad_scale != 1.0 and value.requires_grad:
                value = ScaleGrad.apply(value, self.grad_scale)
            found[name] = value
        return found

    def compute(self, tokens: Tensor, expert: Tensor) -> Tensor:
        """This rank's experts on ``tokens`` (each row to its local expert index), unweighted."""
        view = _View(self.module, num_experts=self.local_experts, **self.weights())
        ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        return self.original(view, tokens, expert.unsqueeze(1), ones)

    def grouped(self, rows: Tensor, offsets: Tensor, valid: Tensor) -> Tensor:
        """This rank's experts on ``rows`` sorted by expert (see :func:`grouped_experts`), unweighted."""
        weights = self.weights()
        return grouped_experts(self.module, weights["gate_up_proj"], weights["down_proj"], rows, offsets, valid)

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args: Any,
                 **kwargs: Any) -> Tensor:
        if args or kwargs:
            raise TypeError(f"{type(self.module).__name__} under lightning_4d takes (hidden_states, top_k_index,"
                            " top_k_weights) only")
        if self.tp_group is not None:
            hidden_states = _SumGradOver.apply(hidden_states, self.tp_group)
            top_k_weights = _SumGradOver.apply(top_k_weights, self.tp_group)
        if self.dispatch is not None:
            out = self.dispatch(hidden_states, top_k_index, top_k_weights)
        else:
            view = _View(self.module, **self.weights())
            out = self.original(view, hidden_states, top_k_index, top_k_weights)
        if self.tp_group is not None:
            out = _SumOver.apply(out, self.tp_group)
        return out


def grouped_experts(module: nn.Module, gate_up: Tensor, down: Tensor, rows: Tensor, offsets: Tensor,
                    valid: Tensor) -> Tensor:
    """Experts ``gate_up`` [L, 2I, H] / ``down`` [L, H, I] on ``rows`` [N, H] sorted by expert (``offsets``: each
    expert's end row, on the device, so the host never reads them), unweighted: two grouped matmuls around the
    module's gate, its own arithmetic where :func:`grouped_reproduces` says so. Rows where ``valid`` is False
    (past ``offsets[-1]``) are padding: the gate sees zeros there, and their outputs are to be ignored."""
    if torch.is_autocast_enabled(rows.device.type):  # grouped_mm is on no autocast list: cast as linear would
        dtype = torch.get_autocast_dtype(rows.device.type)
        rows, gate_up, down = rows.to(dtype), gate_up.to(dtype), down.to(dtype)
    up = torch.where(valid, F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets), 0)
    if hasattr(module, "_apply_gate"):  # transformers' experts: their gate
        inner = module._apply_gate(up)
    else:
        gate, up = up.chunk(2, dim=-1)
        inner = module.act_fn(gate) * up
    return F.grouped_mm(inner, down.transpose(-2, -1), offs=offsets)


GROUPED_ALIGNMENT = 8  # grouped_mm wants row strides of 16 bytes: hidden and inner sizes in multiples of 8


def grouped_reproduces(module: nn.Module, found: FusedExperts) -> bool:
    """Whether :func:`grouped_experts` computes what the module's own forward does: sizes grouped_mm accepts,
    and the same outputs on a probe (random weights of 2 experts at a small size, 6 tokens, top-2; pure, no
    collective, whatever device or size the module's weights have)."""
    if found.hidden % GROUPED_ALIGNMENT or found.inner % GROUPED_ALIGNMENT or not hasattr(module, "act_fn"):
        return False
    generator = torch.Generator().manual_seed(0)
    size, experts = 8, 2
    gate_up = torch.randn(experts, 2 * size, size, generator=generator)
    down = torch.randn(experts, size, size, generator=generator)
    tokens = torch.randn(6, size, generator=generator)
    top_k_index = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [1, 0], [0, 1]])
    top_k_weights = torch.rand(6, 2, generator=generator)
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    offsets = torch.bincount(pairs, minlength=experts).cumsum(0).to(torch.int32)
    with torch.no_grad():
        try:
            view = _View(module, num_experts=experts, gate_up_proj=gate_up, down_proj=down)
            expected = type(module).forward(view, tokens, top_k_index, top_k_weights)
            out = grouped_experts(module, gate_up, down, tokens[order // 2], offsets,
                                  torch.ones(len(order), 1, dtype=torch.bool))
        except Exception:  # noqa: BLE001  a forward of another form: not what grouped_experts computes
            return False
    got = torch.zeros_like(tokens).index_add(0, order // 2, out * top_k_weights.reshape(-1)[order, None])
    return isinstance(expected, Tensor) and expected.shape == got.shape and torch.allclose(got, expected, 1e-5, 1e-6)


class _SumOverScaled(torch.autograd.Function):
    """Forward: the sum over ``group`` of each rank's partial sums. Backward: the gradient times the group's size,
    so that the data-parallel average of the ranks' gradients is the gradient of the global quantity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.size = dist.get_world_size(group)
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.size, None


def global_balancing_loss(group: dist.ProcessGroup) -> Callable[..., Any]:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's auxiliary loss) over the global batch:
    the share of tokens routed to each expert and the mean router probability per expert are means over every
    token of every rank of ``group`` (``dp x cp``), as one process computes them on the whole batch; each rank's
    value is the global one. (Per rank, the product of two local means differs from the global product.)"""

    def loss(gate_logits: Any, num_experts: Optional[int] = None, top_k: int = 2,
             attention_mask: Optional[Tensor] = None) -> Any:
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        device = gate_logits[0].device
        logits = torch.cat([layer.to(device) for layer in gate_logits], dim=0)
        routing = torch.nn.functional.softmax(logits, dim=-1)
        _, selected = torch.topk(routing, top_k, dim=-1)
        mask = torch.nn.functional.one_hot(selected, num_experts).float()  # [tokens, k, E]
        if attention_mask is None:
            weight = torch.ones(logits.shape[0], dtype=routing.dtype, device=device)
        else:
            layers = logits.shape[0] // attention_mask.numel()
            weight = attention_mask.to(device, routing.dtype).reshape(1, -1).expand(layers, -1).reshape(-1)
        sums = torch.cat([(mask * weight[:, None, None]).sum(0).reshape(-1), weight.sum().reshape(1)])
        sums = sums.detach()
        dist.all_reduce(sums, group=group)
        count = sums[-1]
        tokens_per_expert = sums[:-1].view(top_k, num_experts) / count
        router_prob = _SumOverScaled.apply((routing * weight[:, None]).sum(0), group) / count
        return torch.sum(tokens_per_expert * router_prob.unsqueeze(0)) * num_experts

    return loss


# --------------------------------------------------------------------------- hand-written nn.ModuleList experts

ROUTER_NAMES = ("router", "gate")
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "k")


@dataclass(frozen=True)
class ExpertList:
    """A hand-written MoE module: ``experts`` (an ``nn.ModuleList`` of alike expert modules), a linear router
    child scoring every expert, and an integer top-k; ``renormalize``: whether the chosen weights are divided by
    their sum (decided by :func:`check_expert_list`)."""

    fqn: str
    cls: str
    experts: int
    router: str
    top_k: int
    renormalize: Optional[bool] = None


def find_expert_lists(module: nn.Module) -> dict[str, ExpertList]:
    """Every module holding ``experts = nn.ModuleList([...])`` of one class with parameters of equal shapes and
    no buffers, a linear router child (``router`` or ``gate``) with one output per expert, and a top-k attribute
    (``top_k``, ``num_experts_per_tok`` or ``k``); pure."""
    found = {}
    for fqn, m in module.named_modules():
        experts = getattr(m, "experts", None)
        if not isinstance(experts, nn.ModuleList) or len(experts) < 2:
            continue
        shapes = {(type(e), tuple((n, tuple(p.shape)) for n, p in e.named_parameters())) for e in experts}
        if len(shapes) != 1 or any(True for e in experts for _ in e.buffers()):
            continue
        router = next((name for name in ROUTER_NAMES if isinstance(getattr(m, name, None), nn.Linear)
                       and getattr(m, name).out_features == len(experts)), None)
        top_k = next((getattr(m, name) for name in TOP_K_NAMES if type(getattr(m, name, None)) is int), None)
        if router is not None and top_k is not None:
            found[fqn] = ExpertList(fqn, type(m).__name__, len(experts), router, top_k)
    return found


def route(moe: nn.Module, found: ExpertList, x: Tensor, run: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """The common hand-written top-k MoE forward: softmax over the router's scores, the top-k experts (their
    weights divided by their sum when ``found.renormalize``), ``run(tokens, top_k_index, top_k_weights)``."""
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    probs = torch.nn.functional.softmax(getattr(moe, found.router)(tokens), dim=-1)
    weights, chosen = probs.topk(found.top_k, dim=-1)
    if found.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return run(tokens, chosen, weights).view(shape)


def run_each_expert(experts: list[Callable[[Tensor], Tensor]]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Every (token, expert) pair computed by its expert, weighted and added, expert by expert."""

    def run(tokens: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(experts):
            token, slot = torch.where(chosen == index)
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out

    return run


def check_expert_list(moe: nn.Module, found: ExpertList) -> Optional[ExpertList]:
    """``found`` with the routing that reproduces ``moe``'s own forward on a probe batch (pure, on this rank's
    weights, no collective), or None when neither variant does (its routing cannot be reached)."""
    weight = getattr(moe, found.router).weight
    if weight.device.type == "meta":
        return None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            expected = moe(x)
        except Exception:  # noqa: BLE001  a forward with other arguments: not the form this reproduces
            return None
        if not isinstance(expected, Tensor) or expected.shape != x.shape:
            return None
        for renormalize in (True, False):
            candidate = ExpertList(**{**found.__dict__, "renormalize": renormalize})
            got = route(moe, candidate, x, run_each_expert(list(moe.experts)))
            if torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
                return candidate
    return None
