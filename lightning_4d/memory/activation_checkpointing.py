"""Activation checkpointing of an unchanged module's blocks: keep less for backward, recompute the rest.

Modes (``FourDStrategy(activation_checkpointing=...)``):

* ``"none"``: every activation is kept for backward.
* ``"full"``: each block keeps only its inputs; its forward runs again during backward.
* ``"every_n"``: ``"full"`` for every ``activation_checkpointing_every``-th block (counted from the first
  block of the whole model, so the same blocks under any pipeline split), the others keep everything.
* ``"selective"``: each block keeps the outputs of its matmuls and collectives and recomputes the rest
  (norms, activations, residual adds, rotary, and attention: under context parallelism attention is ring
  attention, which merges its kernels' outputs in place, so a kept kernel output would be overwritten).

The blocks are the pipeline's block list (the longest list of repeated modules, or ``pp_blocks``). Each
block's ``forward`` is replaced on the instance by a checkpointed call of the original, so parameter names,
state dicts and the hooks other dimensions put on the block stay as they are; hooks on modules inside a block
run again in the recomputation, as they run in the forward.

The recomputation happens during backward, inside a context the composition gives (context parallelism's
attention interception), so a recomputed attention is ring attention again over the same global positions;
a recomputed tensor-parallel region computes its shard again, as its hooks and DTensor parameters are the
forward's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from lightning_4d import _compat as compat

MODES = ("none", "full", "every_n", "selective")

aten = torch.ops.aten
# Ops whose outputs "selective" keeps: the matmuls (collectives are kept too, see _keep_expensive).
_SAVED = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """``activation_checkpointing`` and ``activation_checkpointing_every``, validated on construction."""

    mode: str = "none"
    every: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activation_checkpointing={self.mode!r} is not a mode: use one of {', '.join(MODES)}.")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"activation_checkpointing_every={self.every!r} must be a positive number of blocks"
                             " (2: every second block is checkpointed).")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def checkpointed(self, position: int) -> bool:
        """Whether the block at ``position`` in the whole model's block list is checkpointed."""
        return self.mode != "none" and (self.mode != "every_n" or position % self.every == self.every - 1)


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    if packet in _SAVED or compat.op_qualified_name(packet).startswith(compat.FUNCTIONAL_COLLECTIVE_NAMESPACES):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _both(outer: AbstractContextManager[None], inner: AbstractContextManager[None]) -> Iterator[None]:
    with outer, inner:
        yield


def _checkpointed_forward(forward: Callable[..., Any], context_fn: Callable[[], Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
            return forward(*args, **kwargs)
        if context_fn is noop_context_fn:  # torch.compile traces a checkpoint whose context_fn it can see
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def apply_activation_checkpointing(blocks: list[tuple[int, nn.Module]], config: ActivationCheckpointConfig,
                                   recompute_context: Optional[Callable[[], AbstractContextManager[None]]] = None
                                   ) -> list[int]:
    """Checkpoint the blocks ``config`` selects among ``blocks`` (position in the whole model, block); returns
    the positions checkpointed. ``recompute_context``, if given, is entered around each recomputation (context
    parallelism's attention interception)."""
    if not config.enabled:
        return []
    contexts = (functools.partial(create_selective_checkpoint_contexts, _keep_expensive)
                if config.mode == "selective" else noop_context_fn)

    def with_recompute_context() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        forward, recompute = contexts()
        return forward, _both(recompute_context(), recompute)

    # torch.compile traces a checkpoint only with torch's own contexts: the composition passes no
    # recompute_context (None) unless context parallelism needs one.
    context_fn = contexts if recompute_context is None else with_recompute_context

    done = []
    for position, block in blocks:
        if config.checkpointed(position):
            block.forward = _checkpointed_forward(block.forward, context_fn)
            done.append(position)
    return done


def disable_kv_caches(module: nn.Module) -> list[str]:
    """Turn off the key/value cache of every Hugging Face model in ``module`` (``config.use_cache``), as
    ``gradient_checkpointing_enable`` does: a checkpointed layer recomputed in backward would append its keys
    and values to the cache a second time and attend over twice the sequence. Returns the models changed."""
    changed = []
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if hasattr(sub, "gradient_checkpointing_enable") and getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(f"{name or 'the module'} ({type(sub).__name__})")
    return changed
