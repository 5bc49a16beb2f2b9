"""Tensor parallelism for torch's ``nn.MultiheadAttention`` (``nn.Transformer``, ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer`` hold them).

Its q, k and v weights are one parameter, ``in_proj_weight`` (rows q|k|v, ``embed_dim`` each, and
``in_proj_bias`` alike), and torch's forward derives the head size from the full ``embed_dim``. So the plan
shards it as a fused q|k|v projection by heads (``FusedQKVLayout``: the rows are permuted once so that each
rank's contiguous shard holds its heads' q, k and v rows; state dicts keep torch's layout) and ``out_proj``
row-wise, and the instance gets lightning_4d's forward (:mod:`lightning_4d.modules.multihead_attention`), which runs
the heads its rank holds. Its size attributes (``num_heads``, ``embed_dim``) keep their global values.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from lightning_4d.modules.multihead_attention import install, unsupported
from lightning_4d.tensor_parallel.plan import FusedQKVLayout, ModuleStyle, TensorParallelPlan, _child, _pattern, _under
from lightning_4d.tensor_parallel.styles import _distribute_params, _fused_state_dict_hooks

ROLE = "multihead"  # the role of an nn.MultiheadAttention's entries in a plan (itself column-wise, out_proj row-wise)
_NAMES = ("in_proj_weight", "in_proj_bias")


def layout(module: nn.MultiheadAttention) -> FusedQKVLayout:
    """The rows of ``in_proj_weight``: ``num_heads`` heads of q, then of k, then of v."""
    return FusedQKVLayout(module.num_heads, module.num_heads, module.head_dim, 0)


def plan_multihead(plan: TensorParallelPlan, modules: dict[str, nn.Module], replicated: list[str]) -> None:
    """Add to ``plan`` every ``nn.MultiheadAttention`` not replicated by the user: itself column-wise (its fused
    ``in_proj``), its ``out_proj`` row-wise. Refuses, before any collective, what the forward does not compute."""
    tp, found = plan.tp_size, []
    for fqn, module in modules.items():
        if isinstance(module, nn.MultiheadAttention) and not _under(fqn, replicated):
            found.append(fqn)
            fix = f"keep it whole with tp_plan: {{'{_pattern(fqn)}': replicate}}"
            problem = unsupported(fqn, module)
            if problem is not None:
                raise ValueError(f"tp={tp}: {problem}, so tensor parallelism cannot shard it by heads. Fix: {fix}.")
            if module.num_heads % tp:
                raise ValueError(f"{fqn} (MultiheadAttention) has {module.num_heads} attention heads, not divisible by"
                                 f" tp={tp}. Fix: choose a tensor-parallel size that divides {module.num_heads}, or"
                                 f" {fix}.")
            if plan.sequence_parallel:
                raise ValueError(f"sequence_parallel=True: {fqn} is an nn.MultiheadAttention, whose sharded forward"
                                 " takes whole sequences only. Use sequence_parallel=False (tensor parallelism still"
                                 f" shards it by heads), or {fix}.")
            plan.styles[fqn] = ModuleStyle("colwise", role=ROLE)
            plan.styles[_child(fqn, "out_proj")] = ModuleStyle("rowwise", role=ROLE)


def shard_multihead(module: nn.MultiheadAttention, mesh: DeviceMesh) -> None:
    """Permute ``in_proj_weight``/``in_proj_bias`` by heads and shard them over ``mesh`` (each rank its heads'
    q, k and v rows), give the instance lightning_4d's forward; ``out_proj`` is styled row-wise on its own.
    Collective-free: every rank holds the same weights (broadcast before)."""
    tp, rows = mesh.size(), layout(module)
    for name in _NAMES:
        param = getattr(module, name)
        if param is not None:
            module.register_parameter(name, nn.Parameter(rows.to_tp(param.detach(), tp, 0),
                                                         requires_grad=param.requires_grad))
    _distribute_params(module, mesh, {name: Shard(0) for name in _NAMES}, None)
    _fused_state_dict_hooks(module, rows, tp, names=_NAMES)
    install(module)
