"""``nn.MultiheadAttention`` with a forward of lightning_4d's own, for tensor and context parallelism.

torch's ``nn.MultiheadAttention.forward`` hands everything to ``F.multi_head_attention_forward``, which derives
its head size from the full ``embed_dim`` (so a head-sharded ``in_proj_weight`` cannot run through it) and calls
``scaled_dot_product_attention`` from inside a torch function (so context parallelism's interception, a function
mode, cannot reach that call). :func:`multihead_forward` computes what torch's forward computes for the cases it
accepts, in steps each dimension can take: the packed q|k|v input projection, heads split, one
``F.scaled_dot_product_attention`` call with torch's mask semantics, dropout, ``out_proj`` called as a module.
With ``need_weights=True`` (torch's default, which most code calling ``attn(x, x, x)[0]`` leaves on) it computes
the weights as torch does then, and returns every head's (averaged, or per head).

* Under tensor parallelism ``in_proj_weight``/``in_proj_bias`` are DTensors sharded by heads (rank r holds its
  heads' q, k and v rows, see ``tensor_parallel.multihead``): the forward runs this rank's heads, the input's
  gradient is summed over tp, and ``out_proj`` (row-wise) sums the heads' outputs. Weights asked for are
  gathered over the heads' ranks (summed for the average), so every rank returns one process's.
* Under context parallelism its attention call is the one the interception turns into ring attention.

The forward is set on the instance (``module.forward``), never on the class, and nothing is registered:
state dicts, parameter names and other ``nn.MultiheadAttention`` instances are untouched.
:class:`MultiheadForwards` installs and removes it.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

# On an instance's __dict__ while context parallelism splits the sequence: False, the weights cannot be formed.
WEIGHTS_ALLOWED = "_lightning_4d_weights_allowed"


def unsupported(fqn: str, module: nn.MultiheadAttention) -> Optional[str]:
    """Why :func:`multihead_forward` cannot stand in for this instance's forward (None: it can)."""
    if module.bias_k is not None or module.bias_v is not None:
        what = "add_bias_kv=True (bias_k/bias_v appended to the keys and values)"
    elif module.add_zero_attn:
        what = "add_zero_attn=True (a zero key and value appended)"
    elif module.in_proj_weight is None:
        what = f"kdim={module.kdim}/vdim={module.vdim} unlike embed_dim={module.embed_dim} (separate q/k/v_proj_weight)"
    else:
        return None
    return (f"{fqn} is an nn.MultiheadAttention with {what}, which lightning_4d's forward for nn.MultiheadAttention"
            " does not compute")


def _heads_of_rank(mask: Tensor, batch: int, heads: int, local: int, rank: int) -> Tensor:
    """A per-head mask ``[batch * heads, L, S]`` cut to this rank's ``local`` heads, as ``[batch, local, L, S]``."""
    return mask.view(batch, heads, *mask.shape[-2:]).narrow(1, rank * local, local)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """torch's mask convention for nn.MultiheadAttention: a boolean True is a position not attended."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _weighed(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout: float) -> tuple[Tensor, Tensor]:
    """Attention as torch's forward computes it when it returns the weights: the softmax of the scaled scores
    (plus the additive mask), dropped out, times the values. Returns the output and the weights per head."""
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)
    weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
    weights = F.dropout(weights, p=dropout) if dropout > 0.0 else weights
    return weights @ v, weights


def _all_heads(weights: Tensor, mesh: Any, num_heads: int, average: bool) -> Tensor:
    """This rank's heads' weights ``[batch, local heads, L, S]`` as one process returns them: averaged over every
    head (``[batch, L, S]``) or per head (``[batch, heads, L, S]``), gathered over tp, gradients sent back."""
    if mesh is None:
        return weights.mean(dim=1) if average else weights
    if average:
        return DTensor.from_local(weights.sum(dim=1) / num_heads, mesh, [Partial()], run_check=False).full_tensor()
    return DTensor.from_local(weights, mesh, [Shard(1)], run_check=False).full_tensor()


def multihead_forward(self: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                      key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                      attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                      is_causal: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """``nn.MultiheadAttention.forward``'s signature and outputs: with ``need_weights=False`` computed head by head
    with one ``F.scaled_dot_product_attention`` call; with ``need_weights=True`` (torch's default) as torch
    computes it then, the scores' softmax times the values, and the weights of every head returned (averaged
    unless ``average_attn_weights=False``). Under context parallelism each rank holds part of the sequence and
    no rank can form the weights over all of it: refused there."""
    if need_weights and not self.__dict__.get(WEIGHTS_ALLOWED, True):
        raise ValueError(
            "nn.MultiheadAttention was called with need_weights=True (its default) under context parallelism:"
            " each rank holds part of the sequence, and the attention weights span all of it. Fix: call it with"
            " need_weights=False where the weights are not used (nn.TransformerEncoderLayer and"
            " nn.TransformerDecoderLayer do), or use cp=1.")
    if is_causal and attn_mask is None:
        raise RuntimeError("nn.MultiheadAttention: is_causal=True needs attn_mask too (the causal mask it hints at),"
                           " as torch's forward requires; e.g. nn.Transformer.generate_square_subsequent_mask.")
    batched = query.dim() == 3
    if not batched:  # [L, E]: one sequence
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
    elif not self.batch_first:  # [L, B, E] -> [B, L, E]
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)

    weight, bias = self.in_proj_weight, self.in_proj_bias
    mesh = weight.device_mesh if isinstance(weight, DTensor) else None
    if mesh is not None:  # this rank's heads: its q, k and v rows, side by side
        weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
    heads = weight.shape[0] // (3 * self.head_dim)
    rank = mesh.get_local_rank() if mesh is not None else 0
    summed: dict[int, Tensor] = {}

    def entering(x: Tensor) -> Tensor:
        """The input as this rank reads it: under tp its gradient is summed over the ranks (each holds a part)."""
        if mesh is None:
            return x
        if id(x) not in summed:
            replicated = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            summed[id(x)] = replicated.to_local(grad_placements=[Partial()])
        return summed[id(x)]

    biases = bias.chunk(3) if bias is not None else (None, None, None)
    if query is key and key is value:
        q, k, v = F.linear(entering(query), weight, bias).chunk(3, dim=-1)
    else:
        q, k, v = (F.linear(entering(x), w, b) for x, w, b in zip((query, key, value), weight.chunk(3), biases))
    batch, length, source = q.size(0), q.size(1), k.size(1)
    q, k, v = (t.reshape(batch, t.size(1), heads, self.head_dim).transpose(1, 2) for t in (q, k, v))

    mask = None
    if not (is_causal and key_padding_mask is None and not need_weights):  # torch's use of the hint alone
        is_causal = False
        if attn_mask is not None:
            mask = _additive(attn_mask, q.dtype)
            if mask.dim() == 3:  # [batch * heads, L, S]
                mask = _heads_of_rank(mask, batch, self.num_heads, heads, rank)
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask, q.dtype).view(batch, 1, 1, source)
            mask = padding if mask is None else mask + padding
    dropout = self.dropout if self.training else 0.0
    weights = None
    if need_weights:
        out, weights = _weighed(q, k, v, mask, dropout)
        weights = _all_heads(weights, mesh, self.num_heads, average_attn_weights)
        weights = weights if batched else weights.squeeze(0)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
    out = self.out_proj(out.transpose(1, 2).reshape(batch, length, heads * self.head_dim))
    if not batched:
        out = out.squeeze(0)
    elif not self.batch_first:
        out = out.transpose(0, 1)
    return out, weights


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module`` runs :func:`multihead_forward` (set on the instance)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is multihead_forward


def install(module: nn.MultiheadAttention) -> bool:
    """Give ``module`` :func:`multihead_forward` (on the instance); False when it has it already."""
    if has_own_forward(module):
        return False
    module.forward = types.MethodType(multihead_forward, module)
    return True


class MultiheadForwards:
    """:func:`multihead_forward` on every ``nn.MultiheadAttention`` of a module that lacks it, for context
    parallelism: on every instance (tensor parallelism's too) ``need_weights=True`` is refused while it stands.
    :meth:`remove` gives back torch's forward to the instances this one installed it on."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        found = [m for m in modules if isinstance(m, nn.MultiheadAttention)]
        self.installed = [m for m in found if install(m)]
        self.sequence_split = found
        for module in found:
            module.__dict__[WEIGHTS_ALLOWED] = False

    def remove(self) -> None:
        for module in self.installed:
            if has_own_forward(module):
                del module.__dict__["forward"]
        for module in self.sequence_split:
            module.__dict__.pop(WEIGHTS_ALLOWED, None)
        self.installed, self.sequence_split = [], []
