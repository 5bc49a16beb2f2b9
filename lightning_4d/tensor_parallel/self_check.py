"""The tensor-parallel self-check: a wrong head count trains a different model without failing, so one
sharded block of each type is compared with an unsharded copy on the first real batch."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_4d.tensor_parallel.loss_parallel import _replication_enter, _replication_exit
from lightning_4d.tensor_parallel.plan import TensorParallelPlan, _pattern

class TensorParallelCheckError(RuntimeError):
    """A sharded block computes something else than its unsharded copy."""


def _check_replicas(module: nn.Module, plan: TensorParallelPlan) -> dict[str, nn.Module]:
    """Unsharded copies of the first block of each type whose children get column/row-wise styles; a container
    without a forward of its own (an ``nn.ModuleDict`` whose children the parent calls) is never called, so it has
    nothing to compare."""
    replicas: dict[str, nn.Module] = {}
    kinds: set[type] = set()
    for fqn, style in plan.styles.items():
        if (
            style.role not in ("attention", "mlp", "multihead", "user")
            or style.style not in ("colwise", "rowwise")
            or "." not in fqn
        ):
            continue
        # A region's projection one level down (torchtitan's qkv_linear.wqkv) is checked in the region: the module
        # between them returns this rank's heads only.
        parent_fqn = max((r for r in plan.regions if fqn.startswith(r + ".")), key=len, default=fqn.rsplit(".", 1)[0])
        parent = module.get_submodule(parent_fqn)
        if (
            isinstance(module.get_submodule(fqn), nn.Embedding)
            or type(parent) in kinds
            or type(parent).forward is nn.Module.forward
        ):
            continue
        kinds.add(type(parent))
        replicas[parent_fqn] = copy.deepcopy(parent)
    return replicas


def _materialize_replica(replica: nn.Module, block: nn.Module, state: dict[str, Any], device: str) -> None:
    """A copy made from a meta-built block has no values: storage for it, and the block's buffers that its state
    dict leaves out (rotary tables), which the block's initializer computed."""
    if not any(t.is_meta for t in (*replica.parameters(), *replica.buffers())):
        return
    replica.to_empty(device=device)
    for name, buffer in replica.named_buffers():
        if name not in state:
            value = block.get_buffer(name)
            buffer.copy_(_full(value))


def _sequence(value: tuple | list, items: Iterable[Any]) -> tuple | list:
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples take positionals


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return _sequence(value, [_snapshot(v) for v in value])
    if isinstance(value, dict) and type(value) is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:  # objects that cannot be copied (handles, generators) are passed as they are
        return value


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (tuple, list)):
        return _sequence(value, [_full(v) for v in value])
    if isinstance(value, dict) and type(value) is dict:
        return {k: _full(v) for k, v in value.items()}
    return value


class TensorParallelSelfCheck:
    """Compares each distinct sharded block with its unsharded copy on the first real input.

    ``arm()`` before a forward captures every checked block's input once; ``verify()`` afterwards
    (collective over the tp group) runs the sharded block and its copy in eval mode under
    ``no_grad`` on that input, compares the first tensor each returns, raises
    ``TensorParallelCheckError`` on every rank if one differs by more than ``rtol`` (relative to
    the copy's largest value; default 1e-4 for fp32, 16 eps otherwise), and frees the copies.
    """

    def __init__(
        self,
        targets: dict[str, tuple[nn.Module, nn.Module]],
        mesh: DeviceMesh,
        plan: TensorParallelPlan,
        rtol: float | None = None,
    ) -> None:
        self.targets, self.mesh, self.plan, self.rtol = targets, mesh, plan, rtol
        self.captured: dict[str, tuple[tuple, dict]] = {}
        self._handles: list[Any] = []

    def arm(self) -> None:
        for fqn, (block, _) in self.targets.items():
            self._handles.append(
                block.register_forward_pre_hook(partial(self._capture, fqn), with_kwargs=True, prepend=True)
            )

    def _capture(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if fqn not in self.captured:
            self.captured[fqn] = (_snapshot(args), _snapshot(kwargs))

    @torch.no_grad()
    def verify(self, failed: bool = False) -> dict[str, float]:
        """Returns the relative error per checked block; raises TensorParallelCheckError on a mismatch.

        ``failed``: the armed forward raised. Only the blocks that got an input are checked, so that a sharded
        block that cannot run at all (a size attribute left global breaks its ``view``) is named.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        missing = [fqn for fqn in self.targets if fqn not in self.captured]
        if missing and not failed:
            raise RuntimeError(
                f"Tensor-parallel self-check: no input captured for {missing}; call arm() before a forward."
            )
        checked = [fqn for fqn in self.targets if fqn in self.captured]
        errors, tolerances, raised = [], [], {}
        for fqn in checked:
            block, replica = self.targets[fqn]
            args, kwargs = self.captured[fqn]
            # The copy was made before sharding; a checkpoint restore or ``init_from`` has replaced the weights
            # since. The block's state_dict is in the original layout (fused q|k|v un-permuted).
            state = {k: _full(v) for k, v in block.state_dict().items()}
            _materialize_replica(replica, block, state, self.mesh.device_type)
            replica.load_state_dict(state)
            reference = self._run(replica, _full(_snapshot(args)), _full(_snapshot(kwargs)))
            try:
                sharded = self._run(block, _snapshot(args), _snapshot(kwargs))
            except Exception as error:  # noqa: BLE001  reported below, after every rank has taken part
                raised[fqn], sharded = f"{type(error).__name__}: {error}", None
            if reference is None:
                raise RuntimeError(f"Tensor-parallel self-check: {fqn} returned no tensor.")
            eps = torch.finfo(reference.dtype).eps if reference.is_floating_point() else 0.0
            tolerances.append(
                self.rtol if self.rtol is not None else (1e-4 if reference.dtype == torch.float32 else 16 * eps)
            )
            if sharded is None or sharded.shape != reference.shape:
                errors.append(math.inf)
            else:
                scale = reference.abs().max().clamp_min(1e-12)
                errors.append(((sharded.float() - reference.float()).abs().max() / scale).item())
        worst = torch.tensor(errors, dtype=torch.float64)
        if checked:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
        result = dict(zip(checked, worst.tolist()))
        self.targets, self.captured = {}, {}
        for (fqn, err), tol in zip(result.items(), tolerances):
            if not err <= tol:
                what = (
                    f"the sharded block raised {raised[fqn]}, while its unsharded copy runs"
                    if fqn in raised
                    else f"the sharded block's output differs from its unsharded copy by {err:.3g} (relative; "
                    f"tolerance {tol:.1g}), so it would train as a different model"
                )
                raise TensorParallelCheckError(
                    f"Tensor-parallel self-check failed for {fqn}: {what}. Likely cause: a head-count or width "
                    f"attribute not divided by tp={self.plan.tp_size} (divided: {self.plan.attributes.get(fqn, {})}),"
                    f" or a tp_plan entry that does not fit the module's code. Fix: name the size attributes with "
                    f"tp_plan: {{'{_pattern(fqn)}': {{divide: [...]}}}}, "
                    f"or keep it unsharded with tp_plan: {{'{_pattern(fqn)}': replicate}}."
                )
        return result

    def _run(self, block: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
        modes = [(m, m.training) for m in block.modules()]
        block.eval()
        try:
            with contextlib.ExitStack() as stack:
                # A compiled block runs its code eagerly here: the check is about the sharding, and compiling
                # the block for eval under no_grad would only cost time.
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                if self.plan.sequence_parallel:
                    _replication_enter()
                    stack.callback(_replication_exit)
                out = _first_tensor(block(*args, **kwargs))
            return out.full_tensor() if isinstance(out, DTensor) else out
        finally:
            for m, mode in modes:
                m.training = mode


@contextlib.contextmanager
def armed_self_check(check: TensorParallelSelfCheck,
                 unsharded: Callable[[], AbstractContextManager[None]]) -> Iterator[None]:
    """Around the first training step after sharding: each sharded block type against an unsharded copy (with
    FSDP's parameters gathered while the blocks run again)."""
    check.arm()
    try:
        yield
    except Exception:
        with unsharded():
            check.verify(failed=True)  # names a sharded block that could not run; otherwise the error stands
        raise
    with unsharded():
        check.verify()
