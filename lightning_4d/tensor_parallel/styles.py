"""The DTensor parallel styles a ``ModuleStyle`` becomes: torch's column-wise and row-wise styles taught
transformers' ``Conv1D`` (weight stored ``[in, out]``), and a sequence-parallel style that reads a plain input
as replicated."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from lightning_4d import _compat as compat
from lightning_4d.tensor_parallel.plan import _SEQUENCE_DIM, ModuleStyle, _is_conv1d
from lightning_4d.tensor_parallel.user_plan import _parse_layout

def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Conv1DAware(compat.OwnPlacementsStyle):
    """Lets a linear style also take transformers' Conv1D (weight stored [in, out]): ``conv1d`` gives its
    parameters' placements, and ``own_input_layouts`` the input layout it needs (None: the style's own)."""

    conv1d: dict[str, Placement]

    def own_placements(self, module: nn.Module) -> dict[str, Placement] | None:
        return self.conv1d if _is_conv1d(module) else None

    def place(self, module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None) -> None:
        _distribute_params(module, mesh, placements, src)


class _Colwise(_Conv1DAware, ColwiseParallel):
    conv1d = {"weight": Shard(1), "bias": Shard(0)}


class _Rowwise(_Conv1DAware, RowwiseParallel):
    conv1d = {"weight": Shard(0), "bias": Replicate()}
    own_input_layouts = (Shard(-1),)


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
