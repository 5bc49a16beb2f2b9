"""torch.compile of an unchanged module's blocks, as the pipeline cut, tensor and context parallelism left them.

``FourDStrategy(compile=True)`` compiles each block this rank holds (its ``forward`` is replaced on the instance
by the compiled one, so parameter names, state dicts and hooks stay as they are), before sharded data
parallelism, so FSDP's own hooks stay outside the compiled code. With activation checkpointing torch traces
the checkpoint into the compiled block; under context parallelism ``full`` and ``every_n`` checkpointing run
eagerly around it instead (see :mod:`lightning_4d.composition.parallelize`, steps 6 and 7), and where neither works the
blocks stay eager with a warning (:func:`eager_reason`). ``compile={"backend": ..., "mode": ...}`` passes
options on to ``torch.compile``.

Under context parallelism the ring exchange inside attention cannot be traced: it runs eagerly, as one piece
between two compiled graphs, once per attention call. The strategy reports dynamo's graph breaks after the
first training step (:meth:`Compiled.report`), so they are seen, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_4d import _compat as compat

# torch.compile options a user may set; the rest (dynamic shapes, disable) would change what parity means.
_OPTIONS = ("backend", "mode", "fullgraph", "options")


@dataclass(frozen=True)
class CompileConfig:
    """``FourDStrategy(compile=...)``: False, True, or a dict of ``torch.compile`` options, checked here."""

    enabled: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, value: Any) -> CompileConfig:
        if isinstance(value, bool):
            return cls(value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_OPTIONS))
            if unknown:
                raise ValueError(f"compile={value!r}: {', '.join(map(repr, unknown))} is not an option we pass to"
                                 f" torch.compile; use only {', '.join(_OPTIONS)} (or compile=True).")
            backend = value.get("backend", "inductor")
            if isinstance(backend, str) and backend not in torch.compiler.list_backends(exclude_tags=()):
                raise ValueError(f"compile={{'backend': {backend!r}}} is not a torch.compile backend: use one of"
                                 f" {', '.join(torch.compiler.list_backends())}.")
            return cls(True, dict(value))
        raise ValueError(f"compile={value!r} must be True, False or a dict of torch.compile options"
                         f" ({', '.join(_OPTIONS)}).")


def eager_reason(config: CompileConfig, checkpointing: Any, cp: int, tp: int) -> Optional[str]:
    """Why the blocks must stay eager in this layout (None: they compile). With activation checkpointing, torch
    traces the checkpoint into the compiled block, and there it cannot hold the state tensor parallelism's hooks
    keep inside a block, nor, for ``selective`` under context parallelism, let the ring-attention interception
    into the recomputation."""
    if not config.enabled or checkpointing.mode == "none":
        return None
    if tp > 1:
        return (f"activation_checkpointing={checkpointing.mode!r} with tp={tp}: the checkpoint would be traced into"
                " the compiled block, where tensor parallelism's hooks cannot keep their state. To compile under tp,"
                " use activation_checkpointing='none'.")
    if checkpointing.mode == "selective" and cp > 1:
        return (f"activation_checkpointing='selective' with cp={cp}: selective checkpointing is traced into the"
                " compiled block, where context parallelism's attention interception cannot enter the"
                " recomputation. To compile under cp, use activation_checkpointing='full' or 'every_n' (they run"
                " around the compiled block).")
    return None


def _settle(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """Wait, outside the compiled code, for inputs still in flight: a row-wise tensor-parallel module (the
    vocabulary-parallel embedding) returns its all-reduce unwaited, and AOT autograd, given such an input,
    hands DTensor's backward a plain gradient where it needs a DTensor. ``clone`` waits and keeps autograd."""
    if not any(compat.in_flight(value) for value in compat.tree_flatten((args, kwargs))[0]):
        return None
    return compat.tree_map(lambda value: value.clone() if compat.in_flight(value) else value, (args, kwargs))


@dataclass
class Compiled:
    """What :func:`apply_compile` did on this rank, and the graph-break count before it, so that the report
    after the first step counts only this module's breaks."""

    blocks: int
    breaks_before: dict[str, int]
    reported: bool = False

    def breaks(self) -> dict[str, int]:
        """Graph breaks since the blocks were compiled, by reason."""
        since = {reason: count - self.breaks_before.get(reason, 0) for reason, count in compat.graph_breaks().items()}
        return {reason: count for reason, count in since.items() if count > 0}

    def report(self) -> None:
        """Say on rank 0 how many blocks compiled and where dynamo broke their graphs."""
        self.reported = True
        breaks = self.breaks()
        if not breaks:
            rank_zero_info(f"compile: {self.blocks} blocks compiled per rank, without graph breaks.")
            return
        reasons = "; ".join(f"{count}x {reason.strip().splitlines()[0]}" for reason, count in sorted(breaks.items(), key=lambda kv: -kv[1]))
        rank_zero_warn(f"compile: {self.blocks} blocks compiled per rank, with {sum(breaks.values())} graph breaks"
                       f" (code between them runs eager): {reasons}")


def apply_compile(blocks: list[nn.Module], config: CompileConfig) -> Compiled:
    """Compile each of ``blocks`` in place.

    The block's ``forward`` is replaced on the instance by its compiled version (as activation checkpointing
    replaces it), so the block's own hooks stay eager around it: :func:`_settle` must run outside.
    """
    compiled = Compiled(len(blocks), compat.graph_breaks())
    for block in blocks:
        block.register_forward_pre_hook(_settle, with_kwargs=True)
        block.forward = torch.compile(block.forward, **config.options)
    return compiled
