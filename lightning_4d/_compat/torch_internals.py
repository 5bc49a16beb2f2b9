"""torch's private names that lightning-4d reaches: its functional collectives, process-group and mesh internals,
FSDP2's state, the attention kernels that return the log-sum-exp, parallel styles' hooks, nn.Module's registries,
the meta-device helpers (hooks, non-persistent buffers, dispatch modes) and its state-dict staging copy.

Split from :mod:`lightning_4d._compat` (which hands every name on) so that a torch upgrade is adapted in one file
of torch's own; each entry says why no public API does the job.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._ops import OpOverloadPacket
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import SequenceParallel
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map  # noqa: F401 (re-exported)
from torch.utils.data import DataLoader

from lightning_4d import _host_collectives as host


# ------------------------------------------------------------------------------------------------ torch

# Re-exported by lightning_4d._compat: pytree (torch's flattening of nested containers; torch has no public
# pytree module yet) and OpOverloadPacket (the class of ``torch.ops.<namespace>.<op>``, by which telemetry
# tells ops apart).


def op_qualified_name(packet: OpOverloadPacket) -> str:
    """``"namespace::op"`` of an op packet (telemetry matches the functional-collective namespaces)."""
    return packet._qualified_op_name


# Namespaces of torch's functional collectives (what DTensor redistributions call).
FUNCTIONAL_COLLECTIVE_NAMESPACES = ("_c10d_functional::", "_c10d_functional_autograd::")
# ProcessGroup methods that start communication, private ones included (gloo/NCCL bindings call them).
PROCESS_GROUP_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                         "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
                         "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
                         "reduce_scatter_single_coalesced",
                         "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "broadcast", "reduce", "gather",
                         "scatter", "alltoall", "alltoall_base", "barrier", "monitored_barrier", "send", "recv",
                         "recv_anysource", "_end_coalescing")


# The functional collectives DTensor's redistributions call through their module (the collective recorder wraps
# them there: they reach the process group in C++, past its Python methods). The module is private.
FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
                          "reduce_scatter_tensor", "all_to_all_single", "broadcast", "all_gather_tensor_autograd",
                          "reduce_scatter_tensor_autograd", "all_to_all_single_autograd", "all_gather_single_autograd",
                          "reduce_scatter_single_autograd")


def functional_collectives() -> Any:
    import torch.distributed._functional_collectives as functional

    return functional


def all_reduce_in_stream(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (``op``: "sum", "max", "min") as a new tensor, by torch's functional
    collective: the result is waited for where it is first used, as a dependency between device streams (on
    NCCL the host never waits), and torch.compile traces it. On the CPU, c10d's (``_host_collectives``)."""
    if host.on_host(tensor):
        return host.reduced(tensor, op, group)
    return functional_collectives().all_reduce(tensor, op, group)


# torch's entries that F.cross_entropy and F.nll_loss end in, looked up on ``torch._C._nn`` at every call (so a
# replacement there sees every call however the functional was imported), with their positional arguments.
LOSS_ENTRIES = {"cross_entropy_loss": ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing"),
                "nll_loss_nd": ("input", "target", "weight", "reduction", "ignore_index")}


def loss_entry(name: str) -> Callable[..., torch.Tensor]:
    return getattr(torch._C._nn, name)


def set_loss_entry(name: str, function: Callable[..., torch.Tensor]) -> None:
    setattr(torch._C._nn, name, function)


def reduction_code(reduction: str) -> int:
    """The number torch's loss entries take for ``reduction`` ("none", "mean", "sum")."""
    from torch.nn import _reduction

    return _reduction.get_enum(reduction)


def all_gather_in_stream(tensor: torch.Tensor, group: Any, differentiable: bool = False) -> torch.Tensor:
    """``tensor`` gathered over ``group`` along dim 0 (rank order) by torch's functional collective, waited for
    where first used; ``differentiable``: its backward is the reduce-scatter (sum) of the gradient. On the CPU,
    c10d's (``_host_collectives``)."""
    if host.on_host(tensor):
        return host.Differentiable.apply(tensor, group, host.gathered, host.scattered) if differentiable \
            else host.gathered(tensor, group)
    functional = functional_collectives()
    gather = functional.all_gather_tensor_autograd if differentiable else functional.all_gather_tensor
    return gather(tensor, 0, group)


def all_to_all_in_stream(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal chunks of ``tensor``'s dim 0 exchanged over ``group`` (chunk ``j`` to rank ``j``) by torch's functional
    collective, waited for where first used; its backward sends the gradient back the same way. On the CPU,
    c10d's (``_host_collectives``)."""
    if host.on_host(tensor):
        return host.Differentiable.apply(tensor, group, host.exchanged, host.exchanged)
    return functional_collectives().all_to_all_single_autograd(tensor.contiguous(), None, None, group)


def reduce_scatter_in_stream(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over ``group``, each rank keeping its block of dim 0, by torch's functional collective
    (waited for where first used); its backward is the all-gather of the gradient. On the CPU, c10d's
    (``_host_collectives``)."""
    if host.on_host(tensor):
        return host.Differentiable.apply(tensor, group, host.scattered, host.gathered)
    return functional_collectives().reduce_scatter_tensor_autograd(tensor, "sum", 0, group)


def in_flight(value: Any) -> bool:
    """Whether ``value`` is a collective's result not yet waited for (torch's ``AsyncCollectiveTensor``: what
    a row-wise style's ``to_local`` returns after its async all-reduce; no public name tells it apart)."""
    return isinstance(value, functional_collectives().AsyncCollectiveTensor)


def waited(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a plain tensor: a functional collective's result is waited for as a dependency between device
    streams (the host does not wait on NCCL), without the copy that an operation on it would make."""
    return value.trigger_wait() if in_flight(value) else value


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process (the collective timeout applies to each); torch lists them only in
    its private registry."""
    return list(dist.distributed_c10d._world.pg_map)


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """One mesh dim made of several (``dp`` and ``cp`` for the gradient group). DeviceMesh has no public way to
    join dims; the object returned must be kept (looking a flattened name up from the root is deprecated)."""
    return mesh[dims]._flatten(name)


def mesh_with_flattened(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """A sub-mesh of the root ``mesh`` that names a flattened dim (HSDP's ``(dp_replicate, dp_shard_cp)``). FSDP
    needs it sliced from the root that the tensor-parallel mesh also comes from; torch warns that slicing a
    flattened name from the root will be deprecated and offers no other way yet, so the warning is silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh[dims]


@contextmanager
def loss_parallel_ops() -> Iterator[None]:
    """torch's ``loss_parallel()``, entered only where it is not active already. torch's context installs its
    loss ops on entry and deletes them on exit without counting, so inside a user's own ``loss_parallel()`` (a
    module written for ModelParallelStrategy wraps its loss and backward in one) a nested one would delete the
    user's on exit (``KeyError: aten._log_softmax`` when the user's exits). torch has no public way to ask
    whether the ops are installed."""
    from torch.distributed.tensor.parallel import loss_parallel

    if torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers:
        yield
        return
    with loss_parallel():
        yield


def without_function_modes() -> Any:
    """No ``__torch_function__`` mode or subclass handler runs inside: for a check that must reach torch itself
    (``sdpa_operands``'s meta-device call). Inside a mode's handler torch 2.15 can dispatch such a call to the
    modes again (a layer recomputed by activation checkpointing under pipelining sent it back to context
    parallelism's, with meta tensors); torch's switch for it is private."""
    return torch._C.DisableTorchFunction()


def without_subclass_functions() -> Any:
    """Inside, a tensor subclass's ``__torch_function__`` is skipped: the fused LM head's deferred logits compute
    their own metadata and views as plain tensors. torch offers this only as ``torch._C``'s context manager."""
    return torch._C.DisableTorchFunctionSubclass()


def default_store() -> Optional[dist.Store]:
    """The rendezvous store of the default process group (None without one): a side channel that works while
    collectives hang or fail (desync checks, first-failure reports, heartbeats). torch keeps it private."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def fsdp_lazy_init(unit: nn.Module) -> None:
    """Make an FSDP unit a root of its own before its first forward (FSDP does it in that forward), so that it
    can be gathered and reduced first: under pipelining a unit around the blocks may be read without its
    forward running. Idempotent."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(unit)._lazy_init()


def fsdp_defer_backward_end(unit: nn.Module) -> None:
    """Before a pipeline step's micro-batches: the caller ends FSDP's backward itself, after the last one
    (:func:`fsdp_finish_backward`). torch 2.15 asks to be told first (public ``set_manual_backward_finalization``,
    as its own pipelining does); earlier releases have neither the switch nor the need."""
    if hasattr(unit, "set_manual_backward_finalization"):
        unit.set_manual_backward_finalization(True)


def fsdp_finish_backward(unit: nn.Module) -> None:
    """What torch's pipelining runs after the last micro-batch for an FSDP stage module
    (``PipelineStage.perform_reduce_grad``): each parameter group's post-backward (reduce-scatter if gradient sync
    is on, else local accumulation; then reshard), and the root's end-of-backward callback. torch 2.15 has a public
    call for it (``finalize_backward``); before it, the same private names torch's pipelining reached."""
    from torch.distributed.fsdp import fully_shard

    if hasattr(unit, "finalize_backward"):
        unit.finalize_backward()
        unit.set_manual_backward_finalization(False)
        return
    state = fully_shard.state(unit)
    for member in state._state_ctx.all_states:
        for group in member._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


# Attention kernels that return the log-sum-exp, which ring attention needs to merge blocks exactly
# (``F.scaled_dot_product_attention`` returns only the output).
aten = torch.ops.aten
flash_attention_cpu = aten._scaled_dot_product_flash_attention_for_cpu
flash_attention_cpu_backward = aten._scaled_dot_product_flash_attention_for_cpu_backward
flash_attention_cuda = aten._scaled_dot_product_flash_attention
flash_attention_cuda_backward = aten._scaled_dot_product_flash_attention_backward
efficient_attention_cuda = aten._scaled_dot_product_efficient_attention
efficient_attention_cuda_backward = aten._scaled_dot_product_efficient_attention_backward
# Every attention kernel and the position of its ``is_causal`` argument, for telemetry's FLOP count.
ATTENTION_KERNELS: dict[Any, int] = {
    flash_attention_cpu: 4, flash_attention_cuda: 4, efficient_attention_cuda: 6,
    **{getattr(aten, name): position for name, position in (("_scaled_dot_product_cudnn_attention", 6),
                                                            ("_scaled_dot_product_attention_math", 5))
       if hasattr(aten, name)},
}


def in_backward() -> bool:
    """Whether this thread is running an autograd backward (``torch._C._current_graph_task_id``). False while
    dynamo traces, which happens in forward (the private call would break the graph)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def graph_breaks() -> dict[str, int]:
    """Graph breaks dynamo met so far in this process, by reason (torch keeps the count only in a private
    counter; ``torch._dynamo.explain`` would compile again to find them)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def tensor_version(tensor: torch.Tensor) -> int:
    """A counter that every in-place change of ``tensor`` bumps: a mask checked once stays checked while it is
    unchanged (autograd's own use of it is the only public trace)."""
    return tensor._version


def passing_output(style: type, keep: Callable[[Any], bool]) -> type:
    """``style`` (a torch ``ParallelStyle`` class) whose output hook hands back the outputs ``keep`` accepts as they
    are: an LM head's logits deferred to its loss are no DTensor to lay out. torch's output hook, the static
    ``_prepare_output_fn``, is private."""
    original = style._prepare_output_fn

    def prepare(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any) -> Any:
        return outputs if keep(outputs) else original(output_layouts, use_local_output, mod, outputs, device_mesh)

    return type(style.__name__, (style,), {"_prepare_output_fn": staticmethod(prepare)})


class OwnPlacementsStyle:
    """Mixin for torch's ColwiseParallel / RowwiseParallel: a module for which ``own_placements(module)`` gives
    parameter placements (transformers' Conv1D stores its weight [in, out]; a peft-wrapped layer's name its
    submodules' parameters too) is distributed with them by one ``place(module, mesh, placements,
    src_data_rank)``, its input brought to ``own_input_layouts`` if set. The
    style's ``_apply`` and its input/output preparation are private: there is no public hook for a module the
    style does not know."""

    own_input_layouts: Any = None

    def own_placements(self, module: nn.Module) -> Any:
        return None

    def place(self, module: nn.Module, mesh: DeviceMesh, placements: Any, src_data_rank: Any) -> None:
        raise NotImplementedError

    def applied(self, module: nn.Module) -> None:
        """Called with each module once the style is applied to it (its parameters distributed, its hooks on)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements = self.own_placements(module)
        if placements is None:
            module = super()._apply(module, device_mesh)
        else:
            if self.own_input_layouts is not None:
                self.desired_input_layouts = self.own_input_layouts
            module = distribute_module(
                module, device_mesh,
                lambda name, m, mesh: None if name else self.place(m, mesh, placements, self.src_data_rank),
                functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
        self.applied(module)
        return module


class SequenceParallelFromPlain(SequenceParallel):
    """SequenceParallel that reads a plain input as replicated (torch's reads it as already sharded), and keeps a
    frozen norm frozen (torch's makes every parameter it replicates trainable); its input preparation and its
    partition function are private methods."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for p_name, param in module.named_parameters(recurse=False):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        if x.placements != sequence_sharding:
            x = x.redistribute(placements=sequence_sharding)
        return (x, *inputs[1:])


# nn.Module's own registries. The pipeline cut swaps a block list's children for one stage's, and stands in
# zero-size buffers for parameters a stage does not hold; context parallelism swaps per-position tables for
# a step. ``register_*``/``setattr`` would refuse a buffer replacing a parameter, or re-register hooks.
def children_of(module: nn.Module) -> dict[str, nn.Module]:
    return module._modules


def set_children(module: nn.Module, children: dict[str, nn.Module]) -> None:
    module._modules = children


def parameters_of(module: nn.Module) -> dict[str, Any]:
    return module._parameters


def buffers_of(module: nn.Module) -> dict[str, Any]:
    return module._buffers


def wrap_index_sampler(loader_class: type, wrap: Callable[[Any, Any], Any]) -> None:
    """Make ``loader_class`` (a DataLoader subclass) iterate ``wrap(loader, sampler)`` instead of its index
    sampler. A DataLoader cannot get another sampler once built, and its iterator reads the private
    ``_index_sampler``; resuming mid-epoch must skip batches of the user's own loader."""
    base = DataLoader._index_sampler
    loader_class._index_sampler = property(lambda self: wrap(self, base.fget(self)))


def copy_state_dict(tensors: dict[str, Any], into: dict[str, Any], non_blocking: bool) -> dict[str, Any]:
    """``tensors`` copied into staging buffers of the same structure; other values taken as they are."""
    from torch.distributed._state_dict_utils import _copy_state_dict

    return _copy_state_dict(tensors, into, non_blocking=non_blocking, type_check=False)


# -------------------------------------------------------------------------------------- meta-device models

def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers left out of its state dict (rotary tables, caches): no checkpoint
    fills them, so a meta-built model must recompute them. torch keeps the set private."""
    return set(module._non_persistent_buffers_set)


def tensor_hooks(tensor: torch.Tensor) -> tuple[Any, Any]:
    """The gradient hooks and post-accumulate-grad hooks registered on ``tensor`` (tensor parallelism's gradient
    sums and placements), as torch keeps them: ``torch.utils.swap_tensors``, which gives a meta parameter its
    storage without changing its identity, leaves them on the Python object but detached from the new storage,
    so they would never run again; :func:`set_tensor_hooks` attaches them. torch keeps both private."""
    return getattr(tensor, "_backward_hooks", None), getattr(tensor, "_post_accumulate_grad_hooks", None)


def set_tensor_hooks(tensor: torch.Tensor, hooks: tuple[Any, Any]) -> None:
    """Attach hooks read by :func:`tensor_hooks` to ``tensor``'s current storage (torch's setters of these
    attributes register them with autograd)."""
    backward, post = hooks
    if backward:
        tensor._backward_hooks = backward
    if post:
        tensor._post_accumulate_grad_hooks = post


def fsdp_reset_sharded_params(unit: nn.Module) -> None:
    """After an FSDP unit's sharded parameters got storage in place (a meta-built model), let FSDP pad them and
    point its flat shard at the new storage, as FSDP's own ``_apply`` override (``to_empty``) does; that override
    cannot be used here, because ``Module._apply`` gives plain parameters new identities and drops their hooks."""
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():
        for group in fully_shard.state(unit)._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()


def dispatch_mode() -> type:
    """torch's base class for a mode that sees every aten op (the initializer's random fills, to seed each
    shard's own): ``torch.utils._python_dispatch.TorchDispatchMode`` has no public home."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode
