"""Sharded data parallelism: torch's FSDP2 (``fully_shard``) over ``dp_shard x cp``, HSDP over ``dp_replicate``.

Each block of the module's block list becomes one FSDP unit (its parameters all-gathered just before it runs
and freed after), and the module itself becomes the root unit that holds everything outside the blocks
(embeddings, head, norms). A module without a block list is one unit.

``shard_units="modules"`` cuts finer, for models where one block is a large share of the model: inside each block
every module that holds a weight matrix directly (a linear or fused-expert weight: a parameter of two or more
dimensions) is a unit of its own, and so is each module around the blocks (embedding, head) that shares no
parameter with another. A rank then holds its shards plus about one weight matrix gathered, with its unsharded
gradient, instead of a block or two and the whole root (embedding and head, gathered from the first forward to
the last backward). It costs an all-gather and a reduce-scatter per unit instead of per block, and code that
reads such a module's weight outside that module's forward (``F.linear(h, self.lm_head.weight)``) reads a shard. Parameters, gradients and optimizer
state are DTensors sharded on dim 0 over the ``dp_shard x cp`` ranks (context-parallel ranks hold the same
weights, so they share the shards); under tensor parallelism the shards are cut again from each tp shard.
With ``dp_replicate > 1`` the mesh is 2-D and the reduce-scattered gradients are also all-reduced over the
replicas (HSDP). FSDP averages the gradients over all of these ranks, so nothing else reduces them.

Gradient accumulation: FSDP starts with gradient sync off; :meth:`ShardedUnits.gradient_sync` turns it on around
the last backward before an optimizer step, so the earlier micro-batches accumulate unsharded gradients locally
instead of reduce-scattering each.

``reshard_after_forward``: ``"auto"`` frees every block's gathered parameters after its forward (ZeRO-3-like)
except the last block's, which backward needs first, and keeps the root's (small, used again by the loss and
first in backward); ``True``/``False`` apply to every block (``False``: ZeRO-2-like, more memory, no second
all-gather in backward). The finer units of ``shard_units="modules"`` are freed after their forward under
``"auto"`` too (gathering one weight matrix again costs little; keeping the last block's would cost a block).
An embedding unit is not gathered again for backward at all: its backward reads only the indices.

Step methods: FSDP runs its root hooks around ``forward``; a LightningModule's ``training_step`` may call its
submodules without ``forward``, so the step methods the module defines are registered as FSDP forward
methods too (``torch.distributed.fsdp.register_fsdp_forward_method``).

Pipelining: the stage's step stops inside the module at the stage boundary, so the module is no unit; the
modules around the blocks that hold parameters are units of their own (those whose parameters are shared, or
held directly by a module above the blocks, stay replicated). Every unit stays gathered for the whole pipeline
step, as torchtitan does under pp: every micro-batch would gather it again, and the zero-bubble schedules run
a micro-batch's weight gradients after later micro-batches' forwards. The gradients of all micro-batches are
reduce-scattered once, after the schedule, like torch's pipelining does for an FSDP stage module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from lightning_4d import _compat as compat

RESHARD_CHOICES = ("auto", True, False)
UNIT_CHOICES = ("blocks", "modules")
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")

ReshardAfterForward = Union[bool, str]


def check_reshard_after_forward(value: object) -> None:
    """``reshard_after_forward`` is ``"auto"``, ``True`` or ``False`` (checked before any process starts)."""
    if value not in RESHARD_CHOICES or (value in (0, 1) and not isinstance(value, bool)):
        raise ValueError(f"reshard_after_forward={value!r} is not valid: use 'auto' (free each block's gathered"
                         " weights after its forward, except the last block's), True (every block) or False (keep"
                         " them until backward: more memory, one all-gather less per block).")


def check_shard_units(value: object, pp: int = 1, tp: int = 1, compile: bool = False) -> None:
    """``shard_units`` is ``"blocks"`` or ``"modules"``; ``"modules"`` needs eager blocks without pipelining or
    tensor parallelism (checked before any process starts)."""
    if value not in UNIT_CHOICES:
        raise ValueError(f"shard_units={value!r} is not valid: use 'blocks' (one FSDP unit per block, the rest in the"
                         " root) or 'modules' (also one unit per weight matrix inside a block and per module around"
                         " the blocks: least memory, more collectives).")
    if value == "modules" and pp > 1:
        raise ValueError(f"shard_units='modules' with pp={pp}: a pipeline stage keeps its units gathered for the"
                         " whole step, so finer units would save nothing. Use shard_units='blocks' with pp > 1.")
    if value == "modules" and tp > 1:
        raise ValueError(f"shard_units='modules' with tp={tp}: tensor parallelism's hooks on an attention's projections"
                         " must run before FSDP's, which a unit per projection would reverse. Use shard_units='blocks'"
                         f" with tp > 1 (tp={tp} already cuts each weight matrix {tp} ways).")
    if value == "modules" and compile:
        raise ValueError("shard_units='modules' with compile=True: FSDP's hooks inside a compiled block would"
                         " break its graph at every weight. Use shard_units='blocks' to compile, or compile=False.")


def weight_modules(block: nn.Module, skip: frozenset[int] = frozenset()) -> list[nn.Module]:
    """The modules inside ``block`` that hold a weight matrix directly (a parameter of two or more dimensions),
    in ``modules()`` order (outer before inner); a parameter in ``skip`` (by id: replicated or shared) keeps its module out."""
    found = []
    for module in block.modules():
        own = list(module.parameters(recurse=False))
        if module is block or not any(p.dim() >= 2 for p in own) or any(id(p) in skip for p in own):
            continue
        found.append(module)
    return found


def block_reshard(position: int, count: int, reshard_after_forward: ReshardAfterForward) -> bool:
    """Whether the block at ``position`` of the ``count`` blocks this rank shards frees its weights after forward."""
    if reshard_after_forward == "auto":
        return position < count - 1
    return bool(reshard_after_forward)


def param_dtype_for(precision: str) -> Optional[torch.dtype]:
    """FSDP's compute dtype for Lightning's ``precision=`` flag: ``bf16-mixed`` gathers and computes in bf16
    (fp32 master weights and gradient reduction); ``bf16-true``, ``32-true`` and the rest keep the parameters'
    own dtype, as Lightning made them."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def mixed_precision_policy(param_dtype: Optional[torch.dtype]) -> MixedPrecisionPolicy:
    """Compute and all-gather in ``param_dtype`` (None: the parameters' own), reduce gradients in fp32."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_sharding(module: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh, *,
                   reshard_after_forward: ReshardAfterForward = "auto",
                   param_dtype: Optional[torch.dtype] = None,
                   ignored_params: Optional[set[nn.Parameter]] = None,
                   outside: Optional[Sequence[nn.Module]] = None, every_batch: bool = False,
                   around: Sequence[nn.Module] = (), skip: frozenset[int] = frozenset()) -> ShardedUnits:
    """Shard ``blocks`` (one FSDP unit each) and then ``module`` (the root unit) over ``mesh``; collective.

    Under pipelining (``outside`` given) the module is not a unit: the user's step stops inside it at a stage
    boundary, which would leave a root unit's forward unfinished. Each module of ``outside`` (those around the
    blocks that hold parameters) is a unit of its own instead, and every unit keeps its gathered weights from
    the start of a pipeline step to its end (:meth:`ShardedUnits.pipelined_step`).

    ``around`` (``shard_units="modules"``, no pipelining): modules around the blocks that become units of their own
    before the root, and the blocks' weight modules become units before their blocks, except those holding a
    parameter whose id is in ``skip`` (shared with another module).

    ``ignored_params`` stay as they are (replicated; their gradients are the caller's to reduce). Gradient sync
    starts off (see :meth:`ShardedUnits.gradient_sync`), unless ``every_batch``: then every backward
    reduce-scatters, accumulation micro-batches included (FSDP then holds sharded gradients only).
    """
    policy = mixed_precision_policy(param_dtype)
    ignored = ignored_params or None
    pipelined = outside is not None
    units: list[FSDPModule] = []
    fine = bool(around)
    skip = skip | {id(p) for p in ignored or ()}
    for position, block in enumerate(blocks):
        reshard = False if pipelined else block_reshard(position, len(blocks), reshard_after_forward)
        for inner in reversed(weight_modules(block, skip)) if fine else ():  # inner modules before outer ones
            units.append(fully_shard(inner, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                                     reshard_after_forward=reshard_after_forward is not False))
        units.append(fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                                 reshard_after_forward=reshard))
    if pipelined:
        units += [fully_shard(m, mesh=mesh, mp_policy=policy, ignored_params=ignored, reshard_after_forward=False)
                  for m in outside]
    else:
        for unit in around:
            units.append(fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                                     reshard_after_forward=reshard_after_forward is not False))
            if isinstance(unit, nn.Embedding) and reshard_after_forward is not False:
                # An embedding's backward reads only the indices: gathering its table again for backward would
                # cost an all-gather and the table's memory at the very end of backward, where every other
                # unit's sharded gradient is already held.
                unit.set_unshard_in_backward(False)
        root_reshard = False if reshard_after_forward == "auto" else bool(reshard_after_forward)
        units.append(fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=root_reshard,
                                 ignored_params=ignored))
        for name in _step_methods(module):
            register_fsdp_forward_method(module, name)
    sharded = ShardedUnits(units, pipelined, every_batch)
    sharded.set_gradient_sync(every_batch)
    return sharded


class ShardedUnits:
    """This rank's FSDP units, and the switches a training loop turns around them."""

    def __init__(self, units: list[FSDPModule], pipelined: bool, every_batch: bool = False) -> None:
        self.units = units
        self.pipelined = pipelined
        self.every_batch = every_batch  # reduce-scatter after every backward, not only before optimizer steps
        self.syncing = every_batch  # inside :meth:`gradient_sync`, or always
        self._initialized = False

    def set_gradient_sync(self, on: bool) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(on, recurse=not self.pipelined)

    @contextmanager
    def gradient_sync(self) -> Iterator[None]:
        """Reduce-scatter (and, under HSDP, all-reduce) the gradients of the backward that runs inside; off again
        after, so that accumulation micro-batches outside it only accumulate locally (with ``every_batch`` it is
        on all along)."""
        self.set_gradient_sync(True)
        self.syncing = True
        try:
            yield
        finally:
            self.syncing = self.every_batch
            self.set_gradient_sync(self.every_batch)

    @contextmanager
    def pipelined_step(self, training: bool) -> Iterator[None]:
        """Around one pipeline schedule step, as torch's pipelining treats an FSDP stage: every unit gathered
        first (a module around the blocks may be read without its forward running), no reduce-scatter and no
        reshard per micro-batch (a zero-bubble schedule computes a micro-batch's weight gradients after later
        micro-batches ran), then one reduce-scatter of the gradients all micro-batches accumulated, only if
        gradient sync is on, and every unit sharded again. Nothing is sent if the step raised."""
        if not self._initialized:
            for unit in self.units:
                compat.fsdp_lazy_init(unit)
            self._initialized = True
        for unit in self.units:
            unit.unshard()
            if training:
                compat.fsdp_defer_backward_end(unit)
                unit.set_is_last_backward(False)
                unit.set_reshard_after_backward(False, recurse=False)
                unit.set_requires_gradient_sync(False, recurse=False)
        yield
        for unit in self.units:
            if training:
                unit.set_is_last_backward(True)
                unit.set_reshard_after_backward(True, recurse=False)
                unit.set_requires_gradient_sync(self.syncing, recurse=False)
                compat.fsdp_finish_backward(unit)
            else:
                unit.reshard()


def _step_methods(module: nn.Module) -> list[str]:
    """The step methods ``module``'s own class defines (not LightningModule's defaults: registering one of those
    would make Lightning believe the module overrides it)."""
    found = []
    for name in STEP_METHODS:
        for klass in type(module).__mro__:
            if name in vars(klass):
                if not klass.__module__.startswith(("lightning.", "pytorch_lightning.")):
                    found.append(name)
                break
    return found


def own_units(module: nn.Module) -> list[str]:
    """The FSDP units the module's own ``configure_model`` made (``fully_shard`` applied before the strategy
    parallelizes): left as they are, on the mesh and with the mixed precision the module chose."""
    return [name or "<root>" for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]


def check_own_units(units: list[str], module: nn.Module, pp: int, cp: int, ep: int) -> None:
    """A module that sharded itself is left as it is; the dimensions that must reach inside its units refuse it
    (a ValueError, the same on every rank, before any collective of the step)."""
    problems = [(f"pp={pp}", "the pipeline cuts the block list, which FSDP units already wrap") if pp > 1 else None,
                (f"cp={cp}", "its fully_shard reduces gradients over the data-parallel ranks only, and the"
                 " context-parallel ranks hold other tokens of the same samples") if cp > 1 else None,
                (f"ep={ep}", "expert parallelism re-lays the experts FSDP already holds") if ep > 1 else None]
    problems = [p for p in problems if p is not None]
    if problems:
        size, why = problems[0]
        raise ValueError(f"{type(module).__name__}.configure_model applied fully_shard itself ({', '.join(units[:3])}"
                         f"{', ...' if len(units) > 3 else ''}), and FourDStrategy({size}) cannot be combined with a"
                         f" module that sharded itself: {why}. Fix: remove fully_shard from configure_model and pass"
                         " dp_shard= to FourDStrategy (it applies FSDP2 in an order that composes with every"
                         f" dimension), or use {size.split('=')[0]}=1.")


def own_unit_params(module: nn.Module) -> set[int]:
    """Ids of the parameters the module's own FSDP units hold (FSDP reduces their gradients)."""
    return {id(p) for sub in module.modules() if isinstance(sub, FSDPModule) for p in sub.parameters()}


@contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Inside, any submodule of an FSDP unit that runs first gathers its unit's parameters (collective), even when
    called directly rather than through the unit (the tensor-parallel self-check runs attention and MLP modules
    alone, and takes their ``state_dict``, which makes FSDP shard them again); everything is sharded after."""
    units = [module for module in root.modules() if isinstance(module, FSDPModule)]
    handles = []
    for unit in units:
        nested = {id(m) for other in units if other is not unit and _contains(unit, other) for m in other.modules()}
        for module in unit.modules():
            if id(module) not in nested:
                handles.append(module.register_forward_pre_hook(lambda *_, unit=unit: unit.unshard()))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for unit in units:
            unit.reshard()


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(module is inner for module in outer.modules())
