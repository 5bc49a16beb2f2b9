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

The calls are caught where ``F.cross_entropy`` and ``F.nll_loss`` end, torch's ``cross_entropy_loss`` and
``nll_loss_nd`` entries, which the functionals look up at every call: every call is seen however the user's code
imported them, and no other op of the step pays anything (a torch-function mode would put a Python call in front
of every op of the forward). Code that computes such a loss itself on logits that are not yet plain tensors (the
fused LM head, vocabulary-parallel logits) asks :func:`weighed` for it.

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

import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_4d import _compat as compat

NORMALIZATIONS = ("tokens", "batch", "replica")
TOKENS_ATTRIBUTE = "_lightning_4d_tokens"  # on a returned loss: the count of the batch it averages over
_local = threading.local()  # .watching: this thread's entered TokenMeanLosses; .computing: inside one's loss
_entries_lock = threading.Lock()
_entries: dict[str, Callable[..., Tensor]] = {}  # torch's own loss entries, while ours replace them
_entered = 0  # TokenMeanLosses entered, in every thread


def check_normalization(value: object) -> None:
    """Refuse an unknown ``loss_normalization`` before any process starts."""
    if value not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization={value!r}: use 'tokens' (token-mean losses weighted as one process"
                         " weights them: every valid target of an accumulate_grad_batches window counts once, whichever"
                         " rank and batch hold it), 'batch' (every valid target of each batch counts once and the"
                         " window's batches are averaged, as Lightning's gradient accumulation does on one device) or"
                         " 'replica' (each rank's own mean, averaged over the ranks, as DDPStrategy does).")


def _watcher() -> Optional["TokenMeanLosses"]:
    watching = getattr(_local, "watching", None)
    return watching[-1] if watching and not getattr(_local, "computing", False) else None


def weighed(compute: Callable[[str], Tensor], reduction: str, target: Any, ignore_index: int,
            weight: Optional[Tensor]) -> Tensor:
    """``compute(reduction)``, a loss by ``reduction``; a token mean (``"mean"`` over class indices) while a
    :class:`TokenMeanLosses` watches this thread is computed as ``compute("sum")`` and weighed by it."""
    watcher = _watcher()
    if (watcher is None or reduction != "mean" or not isinstance(target, Tensor) or target.is_floating_point()
            or target.is_complex()):
        return compute(reduction)
    return watcher.weigh(compute, target, ignore_index, weight)


def _entry(name: str, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Our replacement of torch's loss entry ``name``: as torch's, unless a watcher is to weigh the call."""
    names = compat.LOSS_ENTRIES[name]
    mean = compat.reduction_code("mean")
    defaults = {"weight": None, "reduction": mean, "ignore_index": -100, "label_smoothing": 0.0}

    def entry(*args: Any, **kwargs: Any) -> Tensor:
        if _watcher() is None or len(args) > len(names) or set(kwargs) - set(names):
            return original(*args, **kwargs)
        call = {**defaults, **dict(zip(names, args)), **kwargs}
        if call["reduction"] != mean:
            return original(*args, **kwargs)

        def compute(reduction: str) -> Tensor:
            return original(*(compat.reduction_code(reduction) if n == "reduction" else call[n] for n in names))

        return weighed(compute, "mean", call["target"], call["ignore_index"], call["weight"])

    return entry


def whole(loss: Tensor) -> Tensor:
    """A loss as a plain tensor holding its whole value. Under ``loss_parallel()`` on vocabulary-sharded logits
    (Lightning's tensor-parallel example keeps its logits a DTensor) the loss is a DTensor; its full value, taken
    differentiably, sends the gradient back through the DTensor loss."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def valid_count(target: Tensor, ignore_index: int, weight: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """What ``reduction='mean'`` divides by: the valid targets, each counted as its class weight."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(dtype)
    weights = weight.to(dtype)[target.masked_fill(~valid, 0)]
    return (weights * valid).sum()


class TokenMeanLosses:
    """Token-mean cross entropy and NLL losses of a step, weighted over ``group`` as one process weights them
    (a context manager, entered around the step's forward).

    ``deferred``: under pipeline parallelism, scale each loss's gradient by the group size only and keep the
    batch's count (:meth:`batch_count`) for the runner, which divides the step's gradients by it (``window``:
    leaves that to :class:`TokenWindow`, at the end of the accumulation window).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], deferred: bool = False, window: bool = False) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.deferred = deferred
        self.window = window
        self.counts: list[Tensor] = []

    def __enter__(self) -> "TokenMeanLosses":
        global _entered
        with _entries_lock:
            if _entered == 0:
                for name in compat.LOSS_ENTRIES:
                    _entries[name] = compat.loss_entry(name)
                    compat.set_loss_entry(name, _entry(name, _entries[name]))
            _entered += 1
        _local.__dict__.setdefault("watching", []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _entered
        _local.watching.pop()
        with _entries_lock:
            _entered -= 1
            if _entered == 0:
                for name, original in _entries.items():
                    compat.set_loss_entry(name, original)
                _entries.clear()

    def weigh(self, compute: Callable[[str], Tensor], target: Tensor, ignore_index: int,
              weight: Optional[Tensor]) -> Tensor:
        """The token mean whose sum ``compute("sum")`` gives, weighed over the group (see the module docstring)."""
        _local.computing = True
        try:
            total = whole(compute("sum"))
        finally:
            _local.computing = False
        # Sum and count travel in fp32 whatever the loss's dtype: a bf16 count is exact only up to 256.
        count = valid_count(target, ignore_index, weight, torch.float32).to(total.device)
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
            factor = self.accumulate / torch.stack(counts).sum()  # on the device: the host never reads the count
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
