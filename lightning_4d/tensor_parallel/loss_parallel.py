"""Vocabulary-parallel loss and the step context of a sharded module.

Inside :func:`tensor_parallel_context`, LM-head logits stay sharded on the vocabulary dim: cross entropy on
them is computed vocabulary-parallel (the full logits are never gathered) and returns a plain loss, and any
other use sees gathered, plain logits. With sequence parallelism, plain tensors that meet sequence-sharded
activations are treated as replicated (re-entrant ``implicit_replication``).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.overrides import TorchFunctionMode

from lightning_4d._compat import loss_parallel_ops, tree_flatten, tree_map
from lightning_4d.numerics.token_losses import weighed
from lightning_4d.tensor_parallel.styles import own_tensor

_local = threading.local()


def _replication_enter() -> None:
    """Re-entrant implicit replication: plain tensors meeting DTensors outside regions are replicated values."""
    depth = getattr(_local, "replication_depth", 0)
    if depth == 0:
        _local.replication = implicit_replication()
        _local.replication.__enter__()
    _local.replication_depth = depth + 1


def _replication_exit() -> None:
    _local.replication_depth -= 1
    if _local.replication_depth == 0:
        _local.replication.__exit__(None, None, None)


_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
    torch.Tensor.__len__, torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.get_device,
    torch.Tensor.is_floating_point, torch.Tensor.ndimension,
}  # fmt: skip
_VOCAB_KEEPING = {
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.to,
    torch.Tensor.contiguous, torch.Tensor.__getitem__, torch.Tensor.transpose, torch.transpose,
    torch.Tensor.permute, torch.permute, torch.Tensor.squeeze, torch.Tensor.unsqueeze,
}  # fmt: skip
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__", "__imod__"}


def _in_place(func: Any) -> bool:
    """A tensor method that changes its first argument: ``mul_``, ``add_``, ``__imul__`` (``*=``), ..."""
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
_TAG = "_lightning_4d_vocab_sharded"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy on vocab-sharded logits with loss_parallel's ops active in backward too, returning a plain loss."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction):
        with torch.enable_grad(), loss_parallel_ops():
            ctx.leaf = logits.detach().requires_grad_()
            ctx.loss = F.cross_entropy(ctx.leaf, target, weight=weight, ignore_index=ignore_index, reduction=reduction)
        return ctx.loss.detach().to_local()

    @staticmethod
    def backward(ctx, grad):
        grad = DTensor.from_local(grad, ctx.loss.device_mesh, ctx.loss.placements, run_check=False)
        with loss_parallel_ops():
            (logits_grad,) = torch.autograd.grad(ctx.loss, ctx.leaf, grad)
        del ctx.leaf, ctx.loss
        return logits_grad, None, None, None, None


class _VocabShardedLogits(TorchFunctionMode):
    """Routes cross entropy on vocab-sharded logits through loss_parallel and gathers them for any other use."""

    def __init__(self) -> None:
        super().__init__()
        self.live = False
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def track(self, logits: DTensor) -> DTensor:
        setattr(logits, _TAG, True)
        self.live = True
        return logits

    def _gather(self, t: Any) -> Any:
        if not getattr(t, _TAG, False):
            return t
        if id(t) not in self.gathered:
            self.gathered[id(t)] = (t, t.full_tensor())
        return self.gathered[id(t)][1]

    def _keep_or_gather(self, out: Any) -> Any:
        if isinstance(out, DTensor):
            if any(p.is_shard() for p in out.placements):
                return self.track(out)
            return out.full_tensor()
        return out

    def _in_place(self, func, args: tuple, kwargs: dict) -> Any:
        """``logits.mul_(s)``, ``logits /= t``, ``logits.masked_fill_(mask, v)``: on the vocabulary-sharded logits
        themselves (a plain tensor operand read as replicated), so that the loss and later uses see the change
        (on a gathered copy it would be lost); a gathered copy made before is dropped. Gathered copies stay views
        made inside an autograd Function, which autograd refuses to change in place while it records: an in-place
        op not recognised here fails there instead of changing a copy."""
        logits = args[0]
        mesh = logits.device_mesh

        def replicated(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > 0:
                return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
            return a

        rest, kwargs = tree_map(replicated, (args[1:], kwargs))
        self.gathered.pop(id(logits), None)
        return func(logits, *rest, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.live or not any(getattr(a, _TAG, False) for a in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            logits, target = a["input"], a["target"]
            if (
                getattr(logits, _TAG, False)
                and logits.dim() >= 2
                and logits.placements == (Shard(1),)
                and not isinstance(target, DTensor)
                and not target.is_floating_point()
                and a["label_smoothing"] == 0.0
                and a["size_average"] is None
                and a["reduce"] is None
            ):

                def compute(reduction: str) -> torch.Tensor:
                    if torch.is_grad_enabled() and logits.requires_grad:
                        return _VocabParallelCrossEntropy.apply(logits, target, a["weight"], a["ignore_index"],
                                                                reduction)
                    with loss_parallel_ops():
                        loss = F.cross_entropy(logits, target, weight=a["weight"], ignore_index=a["ignore_index"],
                                               reduction=reduction)
                    return loss.to_local()

                return weighed(compute, a["reduction"], target, a["ignore_index"], a["weight"])  # a token mean: weighed
        if func is torch.Tensor.__setitem__ and getattr(args[0], _TAG, False):
            raise ValueError(
                "Assignment into the LM head's logits (logits[...] = value) inside a tensor-parallel step: the logits"
                " are sharded over the vocabulary for the loss, and DTensor cannot assign into them (on a gathered"
                " copy the change would not reach the loss). Fix: logits = logits.masked_fill(mask, value) or"
                " logits.masked_fill_(mask, value), or loss_parallel=False.")
        if _in_place(func) and args and getattr(args[0], _TAG, False):
            return self._in_place(func, args, kwargs)
        if func in _VOCAB_KEEPING and not any(
            isinstance(a, torch.Tensor) and not getattr(a, _TAG, False) for a in tree_flatten((args, kwargs))[0]
        ):
            return tree_map(self._keep_or_gather, func(*args, **kwargs))
        args, kwargs = tree_map(self._gather, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def tensor_parallel_context(plan: Any) -> Iterator[None]:
    """Wrap every step (forward and loss) and every backward of a model sharded with ``plan`` (a
    ``TensorParallelPlan``: its ``enabled``, ``sequence_parallel`` and ``loss_parallel`` are read).

    Inside, LM-head logits stay vocab-sharded for cross entropy (``plan.loss_parallel``) and,
    with sequence parallelism, plain tensors that meet sequence-sharded activations, also in
    backward, are treated as replicated.
    """
    with contextlib.ExitStack() as stack:
        if plan.enabled and plan.sequence_parallel:
            _replication_enter()
            stack.callback(_replication_exit)
        if plan.enabled and plan.loss_parallel:
            mode = _VocabShardedLogits()
            previous = getattr(_local, "logits_mode", None)
            _local.logits_mode = mode
            stack.callback(setattr, _local, "logits_mode", previous)
            stack.enter_context(mode)
        yield


def _vocab_head_output(module: nn.Module, inputs: Any, output: DTensor) -> torch.Tensor:
    if not isinstance(output, DTensor):  # deferred to its loss (lightning_4d.numerics.head_loss)
        return output
    mode = getattr(_local, "logits_mode", None)
    return own_tensor(output.full_tensor()) if mode is None else mode.track(output)
