"""The DTensor parallel styles a ``ModuleStyle`` becomes: torch's column-wise and row-wise styles taught
transformers' ``Conv1D`` (weight stored ``[in, out]``), whose plain outputs may be modified in place; a
sequence-parallel style that reads a plain input as replicated; and ``sharded_norm``, a norm over a column-wise
output's sharded features (OLMo 2's q_norm/k_norm)."""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode

from lightning_4d import _compat as compat
from lightning_4d.numerics.head_loss import DeferredLogits
from lightning_4d.tensor_parallel.adapters import adapter_names, adapter_placements
from lightning_4d.tensor_parallel.plan import _SEQUENCE_DIM, ModuleStyle, _FusedRows, _is_conv1d
from lightning_4d.tensor_parallel.user_plan import _parse_layout


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None,
                       recurse: bool = False) -> None:
    """Each parameter (with ``recurse``, of the submodules too; names relative to ``module``) by its placement."""
    for name, param in list(module.named_parameters(recurse=recurse)):
        owner, _, leaf = name.rpartition(".")
        sharded = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src)
        module.get_submodule(owner).register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Conv1DAware(compat.OwnPlacementsStyle):
    """Lets a linear style also take transformers' Conv1D (weight stored [in, out]) and a peft-wrapped layer
    (its adapters placed after its base layer, see ``adapters``): ``conv1d`` and ``linear`` give the base
    layer's placements, ``own_input_layouts`` the input layout it needs (None: the style's own)."""

    conv1d: dict[str, Placement]
    linear: dict[str, Placement]
    name: str

    def own_placements(self, module: nn.Module) -> dict[str, Placement] | None:
        if adapter_names(module):
            base = self.conv1d if _is_conv1d(module) else self.linear
            return adapter_placements(module, self.name, base)
        return self.conv1d if _is_conv1d(module) else None

    def place(self, module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None) -> None:
        _distribute_params(module, mesh, placements, src, recurse=bool(adapter_names(module)))

    def applied(self, module: nn.Module) -> None:
        if _own_forward(module):
            _OwnWeights.attach(module)


def _own_forward(module: nn.Module) -> bool:
    """A subclass of nn.Linear / nn.Embedding with a forward of its own, which may read its weight itself."""
    base = nn.Embedding if isinstance(module, nn.Embedding) else nn.Linear
    return isinstance(module, base) and type(module).forward is not base.forward


class _OwnWeights(TorchFunctionMode):
    """While a sharded module's own forward runs: a plain tensor that is the local shard of one of its weights,
    unchanged (``self.weight.to_local()``, as torchtitan's ``Embedding`` reads its weight before calling
    ``F.embedding``), is passed on as that weight itself, so the torch function computes over the whole
    sharded weight (a vocabulary-parallel lookup) instead of mixing a plain shard with DTensor inputs. Only
    ``torch.nn.functional``'s functions are looked at: the tensor methods inside ``to_local`` are left alone."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.locals: list[tuple[torch.Tensor, DTensor]] = []

    @classmethod
    def attach(cls, module: nn.Module) -> None:
        mode = cls(module)
        module.register_forward_pre_hook(lambda *_: mode.__enter__() and None)  # a pre-hook's result is the input
        # before the style's own output hook, which redistributes the output outside the module's code
        module.register_forward_hook(lambda *_: mode.__exit__(None, None, None), prepend=True, always_call=True)

    def __enter__(self):
        self.locals = [(p.to_local(), p) for p in self.module.parameters(recurse=False) if isinstance(p, DTensor)]
        return super().__enter__()

    def __exit__(self, *exc_info):
        self.locals = []  # no reference to this step's local views outside the forward
        return super().__exit__(*exc_info)

    def _weight(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            for local, param in self.locals:
                if (value.shape == local.shape and value.stride() == local.stride()
                        and value.data_ptr() == local.data_ptr()):
                    return param
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == F.__name__:  # F.embedding, F.linear: not to_local's own view
            args = tuple(self._weight(a) for a in args)
            kwargs = {k: self._weight(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


class _OwnTensor(torch.autograd.Function):
    """Identity whose output is a tensor of its own, not a view.

    ``DTensor.to_local()`` (how column- and row-wise styles hand back a plain output) returns a view made inside
    its own autograd Function, and autograd forbids modifying such a view in place: ``h += residual`` on an
    attention's output would raise "Output 0 of _ToTorchTensor is a view and is being modified inplace". A
    ``detach()`` inside this Function shares the storage and version counter without being a view, so in-place
    arithmetic works as on a plain module's output, without a copy; anything autograd saved from the DTensor
    would still be caught by the version counter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def own_tensor(local: torch.Tensor) -> torch.Tensor:
    """``DTensor.to_local()`` or ``full_tensor()``'s result as a tensor that may be modified in place."""
    return _OwnTensor.apply(local)


def own_output(module: nn.Module, args: tuple, output: object) -> object:
    """Forward hook after a style's own: its plain (local) output as a tensor that may be modified in place (an LM
    head's logits deferred to its loss stay as they are: nothing is computed yet)."""
    if isinstance(output, torch.Tensor) and not isinstance(output, (DTensor, DeferredLogits)):
        return own_tensor(output)
    return None


# An LM head fused with its loss returns deferred logits (lightning_4d.numerics.head_loss): they pass as they are.
class _Colwise(_Conv1DAware, compat.passing_output(ColwiseParallel, lambda out: isinstance(out, DeferredLogits))):
    name = "colwise"
    conv1d = {"weight": Shard(1), "bias": Shard(0)}
    linear = {"weight": Shard(0), "bias": Shard(0)}


class _Rowwise(_Conv1DAware, RowwiseParallel):
    name = "rowwise"
    conv1d = {"weight": Shard(0), "bias": Replicate()}
    linear = {"weight": Shard(1), "bias": Replicate()}
    own_input_layouts = (Shard(-1),)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over ``group``; backward sums the gradient over ``group`` too: every rank's features use
    the summed statistic, so its gradient is the sum of the ranks' parts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "rms_norm_eps")


def rms_form(module: nn.Module) -> tuple[float, float] | None:
    """``(eps, offset)`` when ``module`` computes ``x * rsqrt(mean(x**2, -1) + eps) * (offset + weight)`` (RMSNorm
    with gain ``weight``, offset 0, or ``1 + weight`` as Gemma's, offset 1), with ``eps`` one of its float
    attributes; else None. Decided on a copy with random values at fp32 on the CPU, on rows whose mean squares
    range from 1 to 1e-8, so that a wrong ``eps`` shows; pure, alike on every rank."""
    params = dict(module.named_parameters())
    if set(params) != {"weight"} or params["weight"].dim() != 1 or any(True for _ in module.buffers()):
        return None
    candidates = [v for n in _EPS_ATTRS if isinstance(v := getattr(module, n, None), float)]
    if not candidates:
        return None
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    generator = torch.Generator().manual_seed(0)
    width = params["weight"].numel()
    with torch.no_grad():
        probe.weight.copy_(torch.rand(width, generator=generator) + 0.5)
        x = torch.randn(5, width, generator=generator) * torch.logspace(0, -4, 5)[:, None]
        try:
            out = probe(x)
        except Exception:  # noqa: BLE001  not a norm this fast path computes: DTensor's generic path instead
            return None
        for eps in candidates:
            for offset in (0.0, 1.0):
                expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + probe.weight)
                if isinstance(out, torch.Tensor) and out.shape == x.shape and torch.allclose(
                        out, expected, rtol=1e-4, atol=0.0):
                    return eps, offset
    return None


def _sharded_rms_forward(module: nn.Module, group: dist.ProcessGroup, width: int, eps: float, offset: float,
                         x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over ``width`` features of which ``x`` holds this rank's slice: one all-reduce of the per-rank
    sums of squares (``[..., 1]``), in fp32; the output has ``x``'s dtype."""
    if isinstance(x, DTensor):
        x = x.redistribute(placements=[Shard(x.dim() - 1)]).to_local()
    x32 = x.float()
    total = _SumOverRanks.apply(x32.pow(2).sum(-1, keepdim=True), group)
    weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
    gain = weight.float() + offset if offset else weight.float()
    return (x32 * torch.rsqrt(total / width + eps) * gain).to(x.dtype)


def shard_norm(module: nn.Module, mesh: DeviceMesh) -> None:
    """The ``sharded_norm`` style: a norm over the features of a column-wise sharded output (OLMo 2's ``q_norm``
    over the whole q projection, ``num_heads * head_dim`` wide, applied before the heads are split), run on this
    rank's slice of them.

    Its vector parameters (a gain, a bias) are sharded on dim 0 as the projection's output features are (rank r
    holds features ``r*W/tp .. (r+1)*W/tp``, its query heads). An RMSNorm (recognised by :func:`rms_form`) gets a
    forward of its own on the instance: the statistic over the whole width from one all-reduce of the per-rank
    sums of squares, ``[batch, seq, 1]``, and one in backward. Any other norm runs its own, unchanged forward on
    DTensors (its input read as sharded on the last dim): correct for whatever DTensor computes, at DTensor's
    cost (LayerNorm all-gathers its input). Either way the output is this rank's slice as a plain tensor."""
    form = rms_form(module)
    width = next(module.parameters()).numel()

    def partition(name: str, owner: nn.Module, device_mesh: DeviceMesh) -> None:
        if not name:  # the module itself; it has no submodules
            _distribute_params(owner, device_mesh, {n: Shard(0) for n, _ in owner.named_parameters()}, 0)

    if form is not None:
        distribute_module(module, mesh, partition)
        module.forward = partial(_sharded_rms_forward, module, mesh.get_group(), width, *form)
        return

    def sharded_input(owner: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Shard(x.dim() - 1)], run_check=False)
        return (x, *inputs[1:])

    def local_output(owner: nn.Module, output: object, device_mesh: DeviceMesh) -> object:
        if not isinstance(output, DTensor):
            return output
        if output.placements != (Shard(output.dim() - 1),):
            output = output.redistribute(device_mesh, [Shard(output.dim() - 1)])
        return own_tensor(output.to_local())

    distribute_module(module, mesh, partition, sharded_input, local_output)


def _torch_style(style: ModuleStyle, module: nn.Module) -> nn.Module:
    inp, out = _parse_layout(style.input, style.style), _parse_layout(style.output, style.style)
    if style.style == "sequence_parallel":
        return compat.SequenceParallelFromPlain(sequence_dim=_SEQUENCE_DIM)
    if style.style == "colwise":
        keep_dtensor = style.role == "head" and out is None  # vocab-sharded logits, see _vocab_head_output
        return _Colwise(input_layouts=inp, output_layouts=out, use_local_output=not keep_dtensor)
    if isinstance(module, nn.Embedding) and inp is None:
        inp = Replicate()  # token ids are never sharded
    keep_dtensor = isinstance(out, Shard)  # sequence-sharded output stays a DTensor between regions
    return _Rowwise(input_layouts=inp, output_layouts=out, use_local_output=not keep_dtensor)


def _fused_state_dict_hooks(module: nn.Module, layout: _FusedRows, tp: int,
                            names: tuple[str, str] = ("weight", "bias")) -> None:
    """Checkpoints keep the original layout (q|k|v, gate|up); only the live parameter is permuted. ``names``:
    the weight's and the bias's (nn.MultiheadAttention's in_proj_weight and in_proj_bias)."""
    dims = {names[0]: layout.dim, names[1]: 0}

    def to_original(mod, state_dict, prefix, local_metadata):
        for name, dim in dims.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):
                full = layout.to_original(value.full_tensor(), tp, dim)
                state_dict[prefix + name] = distribute_tensor(
                    full, value.device_mesh, value.placements, src_data_rank=None
                )
            elif value is not None:
                state_dict[prefix + name] = layout.to_original(value, tp, dim)

    def to_tp(mod, state_dict, prefix, *args):
        for name, dim in dims.items():
            value, param = state_dict.get(prefix + name), getattr(mod, name, None)
            if value is None or param is None:
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value
            permuted = layout.to_tp(full, tp, dim)
            if isinstance(param, DTensor):
                permuted = distribute_tensor(permuted, param.device_mesh, param.placements, src_data_rank=None)
            state_dict[prefix + name] = permuted

    module.register_state_dict_post_hook(to_original)
    module.register_load_state_dict_pre_hook(to_tp)
