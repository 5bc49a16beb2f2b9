"""The DTensor parallel styles a ``ModuleStyle`` becomes: torch's column-wise and row-wise styles taught
transformers' ``Conv1D`` (weight stored ``[in, out]``), and a sequence-parallel style that reads a plain input
as replicated."""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement

from lightning_4d.tensor_parallel.plan import _SEQUENCE_DIM, ModuleStyle, _is_conv1d
from lightning_4d.tensor_parallel.user_plan import _parse_layout

def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Conv1DAware:
    """Lets a linear style also take transformers' Conv1D (weight stored [in, out]): ``_conv1d`` gives its
    parameters' placements, and ``_conv1d_input`` the input layout it needs (None: the style's own)."""

    _conv1d: dict[str, Placement]
    _conv1d_input: tuple[Placement, ...] | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        if self._conv1d_input is not None:
            self.desired_input_layouts = self._conv1d_input
        return distribute_module(
            module,
            device_mesh,
            lambda _, m, mesh: _distribute_params(m, mesh, self._conv1d, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _Colwise(_Conv1DAware, ColwiseParallel):
    _conv1d = {"weight": Shard(1), "bias": Shard(0)}


class _Rowwise(_Conv1DAware, RowwiseParallel):
    _conv1d = {"weight": Shard(0), "bias": Replicate()}
    _conv1d_input = (Shard(-1),)


class _SequenceParallel(SequenceParallel):
    """SequenceParallel that reads a plain input as replicated, which every plain activation between regions is."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        if x.placements != sequence_sharding:
            x = x.redistribute(placements=sequence_sharding)
        return (x, *inputs[1:])


def _torch_style(style: ModuleStyle, module: nn.Module) -> nn.Module:
    inp, out = _parse_layout(style.input, style.style), _parse_layout(style.output, style.style)
    if style.style == "sequence_parallel":
        return _SequenceParallel(sequence_dim=_SEQUENCE_DIM)
    if style.style == "colwise":
        keep_dtensor = style.role == "head" and out is None  # vocab-sharded logits, see _vocab_head_output
        return _Colwise(input_layouts=inp, output_layouts=out, use_local_output=not keep_dtensor)
    if isinstance(module, nn.Embedding) and inp is None:
        inp = Replicate()  # token ids are never sharded
    keep_dtensor = isinstance(out, Shard)  # sequence-sharded output stays a DTensor between regions
    return _Rowwise(input_layouts=inp, output_layouts=out, use_local_output=not keep_dtensor)
