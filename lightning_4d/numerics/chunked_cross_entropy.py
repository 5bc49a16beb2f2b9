"""The cross entropy of an LM head's output computed a chunk of tokens at a time, never all its logits at once.

:class:`ChunkedCrossEntropy` takes the head's input rows, weight and bias, what was applied to each row of the
logits (``row_ops``) and ``F.cross_entropy``'s arguments. Each chunk's gradients with respect to the rows and
the weights are formed while its loss is, so backward only scales them. That holds a weight-sized gradient from
the forward to the backward, so where many forwards run before their backwards (a pipeline's GPipe schedule)
the head is asked to form them in backward instead (``in_backward``), from each chunk's logits computed again:
one more matmul per chunk, nothing held in between. Under tensor parallelism (a ``head``
with a process group) each rank computes its share of the vocabulary, with two all-reduces per chunk
(:func:`vocabulary_parallel_cross_entropy`). :mod:`.head_loss` decides when a loss is one of these.

``head`` is the call of the head it computes for: ``linear(rows, weight, bias)`` under the head's autocast
state, ``group`` and ``vocab_start`` (tensor parallelism), ``vocab`` and ``owner.chunk_tokens``.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_4d import _compat as compat
from lightning_4d.numerics.token_losses import valid_count


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross entropy of ``linear(rows, weight, bias)`` (then ``row_ops``) against ``target``, a chunk of rows at a
    time. With ``reduction`` ``"sum"`` or ``"mean"`` each chunk's gradients are formed with its loss and backward
    scales them; with ``"none"`` (a gradient per token), or when ``options`` ask for it (``in_backward``), backward
    computes each chunk's logits again and forms them there."""

    @staticmethod
    def forward(ctx, rows, weight, bias, target, class_weight, options):
        head, row_ops, ignore_index, smoothing, reduction, in_backward = options
        ctx.options, ctx.count = options, None
        per_token = reduction == "none"
        chunks = _Chunks(head, rows, weight, bias, ctx.needs_input_grad[:3], row_ops, class_weight, ignore_index,
                         smoothing)
        if per_token or in_backward:  # the loss alone now; backward computes each chunk's logits again
            losses = [chunks.loss(part, target[part], "none" if per_token else "sum") for part in chunks.parts()]
            ctx.save_for_backward(rows, weight, bias, target, class_weight)
            if per_token:
                return torch.cat(losses) if losses else rows.new_zeros(0)
        else:
            losses = []
            for part in chunks.parts():
                with torch.enable_grad():
                    loss = chunks.loss(part, target[part], "sum")
                    chunks.add_gradients(part, loss)
                losses.append(loss.detach())
            ctx.grads = chunks.gradients()
        total = torch.stack([t.float() for t in losses]).sum() if losses else rows.new_zeros((), dtype=torch.float32)
        dtype = losses[0].dtype if losses else rows.dtype
        if reduction == "mean":
            ctx.count = valid_count(target, ignore_index, class_weight, torch.float32)
            total = total / ctx.count
            if not in_backward:
                ctx.grads = [g / ctx.count.to(g.dtype) if g is not None else None for g in ctx.grads]
        return total.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        head, row_ops, ignore_index, smoothing, reduction, in_backward = ctx.options
        if reduction != "none" and not in_backward:
            # formed in forward (a zero-bubble schedule calls backward twice: for the input, then the weights)
            return (*(g * grad.to(g.dtype) if g is not None else None for g in ctx.grads), None, None, None)
        rows, weight, bias, target, class_weight = ctx.saved_tensors
        if ctx.count is not None:  # a mean: each token's share of the upstream gradient
            grad = grad / ctx.count.to(grad.dtype)
        chunks = _Chunks(head, rows, weight, bias, ctx.needs_input_grad[:3], row_ops, class_weight, ignore_index,
                         smoothing)
        for part in chunks.parts():
            with torch.enable_grad():
                loss = chunks.loss(part, target[part], "none" if reduction == "none" else "sum")
                chunks.add_gradients(part, loss, grad[part] if reduction == "none" else grad.to(loss.dtype))
        return (*chunks.gradients(), None, None, None)


class _Chunks:
    """One cross entropy's chunks of rows and the gradients gathered from them.

    When the head runs without autocast in one 32- or 64-bit dtype and nothing but the loss follows its logits
    (the usual fp32 step), each chunk's gradients are formed directly: autograd gives the logits' gradient, two matmuls the
    rows' (into their slice) and the weight's (accumulated in place), so no chunk allocates a weight-sized
    tensor. Otherwise autograd computes them through the chunk's own ops (autocast's casts included): the
    weights are made leaves once (autocast keeps one low-precision copy of a weight leaf for all chunks), the
    rows a leaf per chunk."""

    def __init__(self, head: Any, rows: Tensor, weight: Tensor, bias: Optional[Tensor], wants: tuple,
                 row_ops: tuple, class_weight: Optional[Tensor], ignore_index: int, smoothing: float) -> None:
        self.head, self.rows, self.wants, self.row_ops = head, rows, wants, row_ops
        self.class_weight, self.ignore_index, self.smoothing = class_weight, ignore_index, smoothing
        self.direct = (not head.autocast and not row_ops and rows.dtype == weight.dtype
                       and rows.dtype not in (torch.float16, torch.bfloat16)  # low precision: fp32 sums below
                       and (bias is None or bias.dtype == weight.dtype))
        if self.direct:
            self.weight, self.bias = weight.detach(), bias.detach() if bias is not None else None
        else:
            self.weight = weight.detach().requires_grad_(wants[1])
            self.bias = bias.detach().requires_grad_(wants[2]) if bias is not None else None
        self.grads: list[Optional[Tensor]] = [None, None, None]
        self.chunk: Optional[Tensor] = None
        self.logits: Optional[Tensor] = None  # the direct path's leaf

    def parts(self) -> Iterator[slice]:
        size = self.head.owner.chunk_tokens(self.rows, self.weight.shape[0])
        return (slice(start, start + size) for start in range(0, self.rows.shape[0], size))

    def loss(self, part: slice, target: Tensor, reduction: str) -> Tensor:
        if self.direct:
            self.chunk = self.rows.detach()[part]
            with torch.no_grad():
                logits = F.linear(self.chunk, self.weight, self.bias)
            logits = self.logits = logits.requires_grad_(any(self.wants))
        else:
            self.chunk = self.rows.detach()[part].requires_grad_(self.wants[0])
            logits = self.head.linear(self.chunk, self.weight, self.bias)
        columns = slice(self.head.vocab_start, self.head.vocab_start + logits.shape[-1])
        if self.head.group is not None:  # log_softmax over a share is not the vocabulary's: cross entropy is the same
            for op in self.row_ops:
                logits = logits.to(op.dtype) if op.kind == "log_softmax" and op.dtype else \
                    logits if op.kind == "log_softmax" else op.apply(logits, columns)
            return vocabulary_parallel_cross_entropy(logits, target, self.class_weight, self.ignore_index,
                                                      self.smoothing, reduction, self.head)
        for op in self.row_ops:
            logits = op.apply(logits, columns)
        return F.cross_entropy(logits, target, weight=self.class_weight, ignore_index=self.ignore_index,
                               reduction=reduction, label_smoothing=self.smoothing)

    def add_gradients(self, part: slice, loss: Tensor, grad: Optional[Tensor] = None) -> None:
        """Add the chunk's gradients: the rows' into their slice, the weights' summed (bf16/fp16 ones in fp32)."""
        if not any(self.wants):
            return
        if self.direct:
            (d_logits,) = torch.autograd.grad(loss, [self.logits], grad)
            with torch.no_grad():
                if self.wants[0]:
                    if self.grads[0] is None:
                        self.grads[0] = torch.zeros_like(self.rows)
                    torch.mm(d_logits, self.weight, out=self.grads[0][part])
                if self.wants[1]:
                    if self.grads[1] is None:
                        self.grads[1] = torch.zeros_like(self.weight)
                    self.grads[1].addmm_(d_logits.t(), self.chunk)
                if self.wants[2]:
                    if self.grads[2] is None:
                        self.grads[2] = torch.zeros_like(self.bias)
                    self.grads[2].add_(d_logits.sum(0))
            return
        inputs = [t for t, want in zip((self.chunk, self.weight, self.bias), self.wants) if want]
        found = iter(torch.autograd.grad(loss, inputs, grad))
        for i, want in enumerate(self.wants):
            if not want:
                continue
            g = next(found)
            if i == 0:
                if self.grads[0] is None:
                    self.grads[0] = torch.zeros_like(self.rows)
                self.grads[0][part] = g
            else:
                g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                self.grads[i] = g if self.grads[i] is None else self.grads[i].add_(g)

    def gradients(self) -> list[Optional[Tensor]]:
        """The gradients in the inputs' dtypes."""
        return [g.to(t.dtype) if g is not None else None for g, t in zip(self.grads, (self.rows, self.weight,
                                                                                     self.bias))]


def _summed(part: Tensor, group: Any) -> Tensor:
    """``part`` summed over ``group``; the gradient reaches each rank's part as it is (every rank computes the same
    loss from the sum, so each part's gradient is the sum's)."""
    detached = part.detach()
    return part + (compat.all_reduce_in_stream(detached, "sum", group) - detached)


def vocabulary_parallel_cross_entropy(logits: Tensor, target: Tensor, class_weight: Optional[Tensor],
                                       ignore_index: int, smoothing: float, reduction: str, head: Any) -> Tensor:
    """``F.cross_entropy`` of logits whose vocabulary is split over ``head.group`` (this rank's columns from
    ``head.vocab_start``), as torch defines it with class weights, ``ignore_index`` and label smoothing: two
    all-reduces per chunk (the rows' maxima, then the sums of exponentials, target logits and smoothing terms)."""
    local = logits.shape[-1]
    peak = compat.all_reduce_in_stream(logits.detach().float().amax(-1), "max", head.group)
    shifted = logits.float() - peak.unsqueeze(-1)
    valid = target != ignore_index
    mine = valid & (target >= head.vocab_start) & (target < head.vocab_start + local)
    column = (target - head.vocab_start).clamp(0, local - 1)
    picked = shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1) * mine
    if class_weight is not None:
        weights = class_weight.float()
        own_weights = weights[head.vocab_start:head.vocab_start + local]
        smooth = (shifted * own_weights).sum(-1)
        target_weight = weights[target.masked_fill(~valid, 0)] * valid
    else:
        smooth = shifted.sum(-1)
        target_weight = valid.float()
    parts = _summed(torch.stack([shifted.exp().sum(-1), picked, smooth]), head.group)
    log_sum = parts[0].log()
    nll = (log_sum - parts[1]) * target_weight
    if smoothing:
        total_weight = class_weight.float().sum() if class_weight is not None else float(head.vocab)
        smooth_loss = (total_weight * log_sum - parts[2]) * valid
        nll = (1 - smoothing) * nll + smoothing / head.vocab * smooth_loss
    out = nll.to(logits.dtype) if reduction == "none" else nll.sum().to(logits.dtype)
    return out
