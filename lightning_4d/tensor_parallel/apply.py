"""Sharding a module in place by its plan: parallel styles, fused-qkv permutation with state-dict hooks,
divided size attributes, region hooks (gathering a sequence-sharded input, narrowing what attention code
sees), per-head norm gradients, and tied weights kept one parameter."""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module

from lightning_4d import _compat as compat
from lightning_4d.numerics.clipping import REPEATED_ROWS
from lightning_4d.tensor_parallel.adapters import row_holders
from lightning_4d.tensor_parallel.loss_parallel import _replication_enter, _replication_exit, _vocab_head_output
from lightning_4d.tensor_parallel.plan import (
    Region,
    TensorParallelPlan,
    _child,
    _linear_shape,
    _parameter_owners,
    _pattern,
    _under,
)
from lightning_4d.tensor_parallel.multihead import shard_multihead
from lightning_4d.tensor_parallel.experts import STYLE as EXPERTS_STYLE, apply_experts
from lightning_4d.tensor_parallel.self_check import TensorParallelSelfCheck, _check_replicas
from lightning_4d.tensor_parallel.styles import (
    _distribute_params,
    _fused_state_dict_hooks,
    _torch_style,
    own_output,
    shard_norm,
)

_HIDDEN_ARG_NAMES = ("hidden_states", "x", "hidden", "input", "inputs", "query")
# Per-head attention biases built for every head outside the attention and passed in, batch and heads flattened
# on dim 0 (Bloom's ALiBi, ``[batch * heads, 1, keys]``): each rank keeps the rows of its own heads.
_PER_HEAD_BIAS_ARG_NAMES = ("alibi",)

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
        if self.region.kind == "mlp" or not self.region.narrow:
            return _replace_argument(args, kwargs, key, full)
        local = full.to_local() if isinstance(full, DTensor) else full
        if local.shape[-1] != self.region.width:
            raise RuntimeError(
                f"Attention {self.fqn} got a hidden state of width {local.shape[-1]}, expected {self.region.width}."
            )
        narrowed = local.narrow(-1, 0, self.region.width // self.mesh.size())
        self.swap = (narrowed, full)
        args, kwargs = _replace_argument(args, kwargs, key, narrowed)
        for name in _PER_HEAD_BIAS_ARG_NAMES:
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs = {**kwargs, name: self.own_heads(name, kwargs[name])}
        return args, kwargs

    def own_heads(self, name: str, bias: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's heads (a contiguous block, as the column-wise shard of q holds them)."""
        heads, tp = self.region.heads, self.mesh.size()
        if not heads or bias.shape[0] % heads:
            raise RuntimeError(
                f"Attention {self.fqn} got {name} of shape {tuple(bias.shape)}, whose dim 0 is not batch x heads"
                f" ({heads} heads), so tensor parallelism cannot give each rank its heads' rows. Fix: keep the"
                f" attention unsharded with tp_plan: {{'{_pattern(self.fqn)}': replicate}}.")
        per_rank = heads // tp
        grouped = bias.reshape(-1, heads, *bias.shape[1:])
        return grouped.narrow(1, self.mesh.get_local_rank() * per_rank, per_rank).reshape(-1, *bias.shape[1:])

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


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank's part reaches the input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumColumnsGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient of the last-dim columns from ``start`` on over ``group``
    (what every rank's heads read from a whole projection, each rank's heads giving a part of its gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        shared = grad[..., ctx.start:].contiguous()
        dist.all_reduce(shared, group=ctx.group)
        grad[..., ctx.start:] = shared
        return grad, None, None


def _shared_columns(attention: nn.Module, region: Region, group: dist.ProcessGroup) -> None:
    name, start = region.shared_columns
    attention.get_submodule(name).register_forward_hook(
        lambda module, args, output: _SumColumnsGradOver.apply(output, start, group))


def _replicated_kv(attention: nn.Module, region: Region, group: dist.ProcessGroup) -> None:
    """k and v whole on every rank (fewer key/value heads than ranks): each rank keeps, of their outputs, the
    key/value head its query heads read; gradients of their weights and of their input are summed over tp.
    In a fused projection each rank's shard already holds that head's k and v rows (``FusedQKVLayout``): the
    gradients of those rows are summed over the ranks holding them, and the input's needs nothing more (the
    column-wise style sums each rank's part)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if region.fused is not None:
        for holder, layout in row_holders(attention.get_submodule(region.inputs[0]), region.fused):
            for name, dim in (("weight", layout.dim), ("bias", 0)):
                param = getattr(holder, name, None)
                if param is not None:
                    rows = [(dim, start, length, tp // pieces) for start, length, pieces in layout.repeated(tp)]
                    setattr(param, REPEATED_ROWS, rows)
                    _hook_trainable(param, partial(_sum_repeated_rows, rows, group))
        return
    head = rank * region.kv_heads // tp
    for name in region.replicated_kv_projections:
        projection = attention.get_submodule(name)

        def whole_input(module: nn.Module, args: tuple) -> tuple:
            x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
            return (_SumGradOver.apply(x, group), *args[1:])

        def own_head(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            return output.narrow(-1, head * region.head_dim, region.head_dim)

        projection.register_forward_pre_hook(whole_input)
        projection.register_forward_hook(own_head)
        for param in projection.parameters():
            _hook_trainable(param, _sum_over(group))


def _hook_trainable(param: torch.Tensor, hook: Any) -> None:
    """A gradient hook on ``param`` unless it is frozen: a frozen parameter gets no gradient (autograd refuses
    the hook), and whether it is frozen is checked again before every training step (``ParallelModel``)."""
    if param.requires_grad:
        param.register_hook(hook)


def _sum_repeated_rows(rows: list[tuple[int, int, int, int]], group: dist.ProcessGroup, grad: DTensor) -> DTensor:
    """Sum over the ranks holding them the gradient rows that ``copies`` ranks of ``group`` hold alike (rank r
    holds piece ``r // copies``): each range goes into its slot of its own segment of one zeroed buffer, and one
    all-reduce sums them all (k and v: one collective, not two)."""
    local = grad.to_local().clone()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = [(local.narrow(dim, start, length), copies) for dim, start, length, copies in rows]
    buffer = local.new_zeros(sum(tp // copies * part.numel() for part, copies in parts))
    slots, offset = [], 0
    for part, copies in parts:
        segment = buffer.narrow(0, offset, tp // copies * part.numel()).view(tp // copies, *part.shape)
        slots.append(segment[rank // copies])
        slots[-1].copy_(part)
        offset += segment.numel()
    dist.all_reduce(buffer, group=group)
    for (part, _), slot in zip(parts, slots):
        part.copy_(slot)
    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)


def _grad_like_param(param: nn.Parameter) -> None:
    """Give a gradient its parameter's layout, which optimizers and data-parallel buckets rely on: replicated
    parameters used on sharded activations accumulate Partial gradients, and DTensor's embedding backward
    returns a replicated gradient for a vocabulary-sharded weight."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)




def _global_sizes_in_state_dict(region: nn.Module, held: dict[str, dict[str, int]]) -> None:
    """Size attributes of modules inside ``region`` hold their global values while its state dict is saved or
    loaded: such a module's own state-dict hooks may read them on the original, unsharded rows (torchtitan's
    FusedQKVLinear reshapes wqkv by heads_per_kv and r_dim to rename it wq/wk/wv). The region's hooks run
    before and after those of the modules inside it."""
    modules = {holder: region.get_submodule(holder) for holder in held}
    local = {holder: dict(attrs) for holder, attrs in held.items()}
    original = {holder: {name: getattr(modules[holder], name) for name in attrs} for holder, attrs in held.items()}

    def use(values: dict[str, dict[str, int]]) -> None:
        for holder, attrs in values.items():
            for name, value in attrs.items():
                setattr(modules[holder], name, value)

    region.register_state_dict_pre_hook(lambda *_: use(original))
    region.register_state_dict_post_hook(lambda *_: use(local))
    region.register_load_state_dict_pre_hook(lambda *_: use(original))
    region.register_load_state_dict_post_hook(lambda *_: use(local))


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
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TensorParallelPlan,
    *,
    self_check: bool = True,
    held: Collection[str] | None = None,
) -> TensorParallelSelfCheck | None:
    """Shard ``module`` in place; returns an (unarmed) self-check, or None when off or nothing is sharded.

    Collective over ``tp_mesh``: every rank must call it with an identically initialised module.
    ``module`` may be a pipeline stage cut from the module the plan was made for (plan on the whole model,
    so that the last stage still knows its LM head): ``held`` names the modules (FQNs relative to ``module``)
    this rank holds, from the pipeline plan of its stages, and only plan entries at or inside them are
    applied; ``None`` finds them by inspection (see :meth:`TensorParallelPlan.restricted_to`).
    Parameters are replaced by new DTensor parameters: collect them for an optimizer afterwards.
    """
    if not plan.enabled:
        return None
    if tp_mesh.ndim != 1 or tp_mesh.size() != plan.tp_size:
        raise ValueError(
            f"The plan is for tp={plan.tp_size} but the mesh has shape {tuple(tp_mesh.shape)}; pass mesh['tp']."
        )
    tp = plan.tp_size
    plan = plan.restricted_to(module, held)
    replicas = _check_replicas(module, plan) if self_check else {}

    owners = _parameter_owners(module)

    for fqn, region in plan.regions.items():
        owner = module.get_submodule(fqn)
        if region.fused is not None and region.fused.moves(tp):
            # The projection's rows, and those of each LoRA adapter's lora_B on it, in the same order.
            for holder, layout in row_holders(owner.get_submodule(region.inputs[0]), region.fused):
                for name, dim in (("weight", layout.dim), ("bias", 0)):
                    param = compat.parameters_of(holder).get(name)
                    if param is not None:  # longer than the original where rows repeat (k and v held by several)
                        permuted = layout.to_tp(param.detach(), tp, dim)
                        holder.register_parameter(name, nn.Parameter(permuted, requires_grad=param.requires_grad))
                _fused_state_dict_hooks(holder, layout, tp)
    for fqn, region in plan.regions.items():  # before the attributes are set: it keeps their global values
        global_sizes = {holder: plan.attributes[_child(fqn, holder)] for holder in region.holders
                        if _child(fqn, holder) in plan.attributes}
        if global_sizes:
            _global_sizes_in_state_dict(module.get_submodule(fqn), global_sizes)
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
        if isinstance(target, nn.MultiheadAttention):  # its fused in_proj by heads; out_proj has its own entry
            shard_multihead(target, tp_mesh)
            continue
        if style.style == EXPERTS_STYLE:  # fused 3-D MoE experts: every expert's slice of its intermediate size
            apply_experts(target, fqn, tp_mesh)
            continue
        if style.style == "sharded_norm":  # a norm over a column-wise output's features, on this rank's slice
            shard_norm(target, tp_mesh)
            continue
        parallelize_module(target, tp_mesh, _torch_style(style, target))
        target.register_forward_hook(own_output)  # `h += residual` on its output, as on a plain module's
        if style.role == "head" and plan.loss_parallel:
            target.register_forward_hook(_vocab_head_output)

    group = tp_mesh.get_group()
    for fqn, region in plan.regions.items():
        owner = module.get_submodule(fqn)
        if region.kind == "attention" or plan.sequence_parallel:
            _RegionHooks(fqn, owner, region, tp_mesh)
        for name in region.head_norms:
            for param in owner.get_submodule(name).parameters():
                _hook_trainable(param, _sum_over(group))
        if region.kv_replicated:
            _replicated_kv(owner, region, group)
        if region.shared_columns is not None:
            _shared_columns(owner, region, group)

    if plan.sequence_parallel and plan.styles:
        inside = list(plan.styles) + list(plan.regions)
        for fqn, m in module.named_modules():
            if _under(fqn, inside) or not compat.parameters_of(m):
                continue
            own = compat.parameters_of(m)
            _distribute_params(m, tp_mesh, {n: Replicate() for n in own if own[n] is not None}, 0)
            if not list(m.children()):
                m.register_forward_pre_hook(lambda mod, args: _to_replicated(tp_mesh, args))
        root = module.get_submodule(_common_prefix(inside))
        root.register_forward_pre_hook(lambda *_: _replication_enter())
        root.register_forward_hook(lambda *_: _replication_exit(), always_call=True)

    for tied in owners.values():  # parallelize_module replaced each registration on its own: tie them again
        current = [compat.parameters_of(m)[name] for _, m, name in tied]
        # A registration in a module left unstyled (BERT's cls.predictions.bias, its decoder's bias) follows the
        # sharded one.
        shared = next((p for p in current if isinstance(p, DTensor)), current[0])
        for _, m, name in tied:
            m.register_parameter(name, shared)
    for param in module.parameters():  # deduplicated, so tied parameters get one hook
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_grad_like_param)
    if not replicas:
        return None
    return TensorParallelSelfCheck(
        {fqn: (module.get_submodule(fqn), replica) for fqn, replica in replicas.items()}, tp_mesh, plan
    )


def unmix_foreach(optimizers: Iterable[torch.optim.Optimizer]) -> list[int]:
    """``foreach=False`` on each param group that asked for ``foreach=True`` but holds both tensor-parallel
    DTensors and plain tensors (the norms the plan leaves whole): torch's foreach kernels refuse such a list
    (``got mixed torch.Tensor and DTensor``). The per-tensor update computes the same values; torch's own default
    (``foreach=None``) already takes it for a list with DTensors. Returns the positions of the groups changed."""
    changed = []
    for position, group in enumerate(g for optimizer in optimizers for g in optimizer.param_groups):
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if group.get("foreach") and len(kinds) == 2:
            group["foreach"] = False
            changed.append(position)
    return changed
