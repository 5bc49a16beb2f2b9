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

With ``accumulate_grad_batches=k`` (``"tokens"``) the mean runs over the whole window, as one process computes
it on the window's batches at once (Megatron's per-token loss, the HF Trainer's ``num_items_in_batch``): each
batch's gradient is its token sum, and :class:`TokenWindow` divides the window's gradients by its count once
they are synchronized, before Lightning clips them. ``"batch"`` keeps Lightning's own accumulation (each batch's
token mean, the window's batches averaged), ``"replica"`` DDP's (each rank's mean, averaged).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_4d import _compat as compat

NORMALIZATIONS = ("tokens", "batch", "replica")
TOKENS_ATTRIBUTE = "_lightning_4d_tokens"  # on a returned loss: the count of the batch it averages over
_SIGNATURES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


def check_normalization(value: object) -> None:
    """Refuse an unknown ``loss_normalization`` before any process starts."""
    if value not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization={value!r}: use 'tokens' (token-mean losses weighted as one process"
                         " weights them: every valid target of an accumulate_grad_batches window counts once, whichever"
                         " rank and batch hold it), 'batch' (every valid target of each batch counts once and the"
                         " window's batches are averaged, as Lightning's gradient accumulation does on one device) or"
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
    batch's count (:meth:`batch_count`) for the runner, which divides the step's gradients by it (``window``:
    leaves that to :class:`TokenWindow`, at the end of the accumulation window).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], deferred: bool = False, window: bool = False) -> None:
        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.deferred = deferred
        self.window = window
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
        if self.group is not None and self.size > 1:  # on the device's streams: the host never waits for it
            both = compat.all_reduce_in_stream(both, "sum", self.group)
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


class TokenWindow:
    """Token-mean losses weighted over an ``accumulate_grad_batches`` window, as one process on all its batches.

    A batch's count is known after its forward, the window's only after its last batch: each batch whose loss
    is a token mean backpropagates its token sum instead (:meth:`take`: the loss's value is unchanged, its
    gradient multiplied by its count; under pipelining the runner leaves the count out), and :meth:`finish`,
    once the window's last backward synchronized the gradients, divides them by the window's count (times
    ``k``, which Lightning divided every loss by). A window whose first loss adds other terms to the token mean
    (or has none) keeps each batch's mean: those terms cannot be weighted by a count; a window mixing the two
    kinds is refused.
    """

    def __init__(self) -> None:
        self.counts: list[Tensor] = []
        self.per_batch: Optional[bool] = None  # decided by the window's first batch
        self.accumulate = 1
        self._warned = False

    def take(self, loss: Any, losses: Optional[TokenMeanLosses], accumulate: int,
             count: Optional[Tensor] = None) -> None:
        """Account for a training batch whose step returned ``loss`` with token-mean ``losses`` running; ``count``:
        the batch's count when the pipeline runner computed it (its gradient is a sum already)."""
        summed = count is not None
        count = count if summed else getattr(loss, TOKENS_ATTRIBUTE, None)
        per_batch = count is None
        if self.per_batch is not None and per_batch != self.per_batch:
            self.counts, self.per_batch = [], None
            raise ValueError(
                f"accumulate_grad_batches={accumulate} with loss_normalization='tokens': within one window some"
                " batches' training_step returned a token-mean cross entropy as it is and others a loss with"
                " other terms (or none), so the window's tokens cannot be weighted as one process weighs them."
                " Return the same kind of loss from every batch, or use FourDStrategy(loss_normalization='batch')"
                " (each batch's token mean, the window's batches averaged, as Lightning's accumulation does).")
        self.per_batch, self.accumulate = per_batch, accumulate
        if per_batch:
            if losses is not None and losses.counts and not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"accumulate_grad_batches={accumulate}: training_step returns a loss computed from a token-mean"
                    " cross entropy and other terms, so each batch keeps its own token mean and the window averages"
                    " the batches (Lightning's accumulation), instead of weighting every token of the window once."
                    " Return the token-mean loss alone for the window-wide mean.")
            return
        self.counts.append(count)
        if not summed and loss.requires_grad:
            loss.register_hook(lambda grad: grad * count)

    def finish(self, params: Iterator[nn.Parameter]) -> None:
        """Divide the window's synchronized gradients by its count; start the next window."""
        counts, per_batch, self.counts, self.per_batch = self.counts, self.per_batch, [], None
        if per_batch is False and counts:
            factor = self.accumulate / float(torch.stack(counts).sum())
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
