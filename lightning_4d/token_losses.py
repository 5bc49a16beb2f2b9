"""Token-mean losses weighted as one process weights them.

``F.cross_entropy`` and ``F.nll_loss`` with ``reduction="mean"`` average over the valid targets of the batch
they see: ``ignore_index`` positions (a masked prompt, the unmasked positions of masked-LM training) count for
nothing, class weights count as their weight. Under data and context parallelism each rank sees part of the
batch, and each part holds its own number of valid targets, so the mean of the ranks' means is not the mean
over the batch (and a part with none is NaN).

While a training step runs, :class:`TokenMeanLosses` computes each such call as a sum and a count, adds both over
the ranks that split the batch (dp x cp, never tp: its ranks see the same tokens; one all-reduce of two numbers),
and returns a loss whose value is the batch's token mean, as one process computes it, and whose gradient is this
rank's sum over its tokens scaled by ``group size / batch count``: the data-parallel average of those gradients
(buckets or FSDP) is the gradient of one process. The loss code stays the user's (a Hugging Face model's
``labels=`` loss goes through the same call); anything computed from the loss keeps its meaning.

Under pipeline parallelism one Lightning batch is several micro-batches whose counts are known only after the
last one: there each loss's gradient is scaled by the group size alone and :meth:`TokenMeanLosses.batch_count`
gives the divisor for the step's gradients (``PipelineRunner``).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

NORMALIZATIONS = ("tokens", "replica")
TOKENS_ATTRIBUTE = "_lightning_4d_tokens"  # on a returned loss: the count of the batch it averages over
_SIGNATURES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


def check_normalization(value: object) -> None:
    """Refuse an unknown ``loss_normalization`` before any process starts."""
    if value not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization={value!r}: use 'tokens' (token-mean losses weighted as one process"
                         " weights them: every valid target of the batch counts once, whichever rank holds it) or"
                         " 'replica' (each rank's own mean, averaged over the ranks, as DDPStrategy does).")


def _token_mean_call(func: Any, args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """The arguments of a class-index token mean (``reduction='mean'``, integer targets, no legacy flags);
    None for any other call, which runs unchanged."""
    try:
        bound = _SIGNATURES[func].bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    target = a["target"]
    if (a["reduction"] != "mean" or a["size_average"] is not None or a["reduce"] is not None
            or not isinstance(target, Tensor) or target.is_floating_point() or target.is_complex()):
        return None
    return dict(a)


def valid_count(target: Tensor, ignore_index: int, weight: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """What ``reduction='mean'`` divides by: the valid targets, each counted as its class weight."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(dtype)
    weights = weight.to(dtype)[target.masked_fill(~valid, 0)]
    return (weights * valid).sum()


class TokenMeanLosses(TorchFunctionMode):
    """Token-mean cross entropy and NLL losses of a step, weighted over ``group`` as one process weights them.

    ``deferred``: under pipeline parallelism, scale each loss's gradient by the group size only and keep the
    batch's count (:meth:`batch_count`) for the runner, which divides the step's gradients by it.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], deferred: bool = False) -> None:
        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.deferred = deferred
        self.counts: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _token_mean_call(func, args, kwargs) if func in _SIGNATURES else None
        if call is None:
            return func(*args, **kwargs)
        target = call["target"]
        total = func(**dict(call, reduction="sum"))
        # Sum and count travel in fp32 whatever the loss's dtype: a bf16 count is exact only up to 256.
        count = valid_count(target, call["ignore_index"], call["weight"], torch.float32).to(total.device)
        both = torch.stack([total.detach().reshape(()).float(), count])
        if self.group is not None and self.size > 1:
            dist.all_reduce(both, group=self.group)
        batch_total, batch_count = both.unbind()
        self.counts.append(batch_count)
        scale = self.size if self.deferred else self.size / batch_count
        scaled = total.float() * scale
        loss = (scaled + (batch_total / batch_count - scaled).detach()).to(total.dtype)
        setattr(loss, TOKENS_ATTRIBUTE, batch_count)
        return loss

    def batch_count(self) -> Optional[Tensor]:
        """The valid targets of every token-mean loss of the step, over the group (None: there was none)."""
        return torch.stack(self.counts).sum() if self.counts else None
