"""The four parallel sizes, their validation, and the device mesh built from them.

Mesh order is ``(pp, dp, cp, tp)``, innermost last. Consecutive ranks share the innermost dims, and on
a real cluster consecutive ranks share a node, so the dims that talk most get the fastest links:

* ``tp`` is innermost: it all-reduces activations in every layer, forward and backward.
* ``cp`` next: its ring passes K/V blocks in every attention layer.
* ``dp`` next: one gradient all-reduce per optimizer step, overlapped with backward.
* ``pp`` outermost: only point-to-point activations per micro-batch, the cheapest to send across nodes.

Gradients are reduced over the joint ``dp_cp`` group: context-parallel ranks see different tokens of the
same samples, so for the weights they are data parallel too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_4d import _compat as compat

MESH_DIMS = ("pp", "dp", "cp", "tp")
GROUP_NAMES = ("dp", "pp", "cp", "tp", "dp_cp")

Size = Union[int, Literal["auto"]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four dims; ``dp * pp * cp * tp == world_size`` always holds once constructed."""

    dp: int
    pp: int
    cp: int
    tp: int

    @classmethod
    def resolve(cls, world_size: int, dp: Size = "auto", pp: int = 1, cp: int = 1, tp: int = 1) -> ParallelDims:
        """Turn user sizes into a layout for ``world_size`` processes, or raise a ValueError that says what to change."""
        cls.check_sizes(dp, pp, cp, tp)
        model_parallel = pp * cp * tp
        if dp == "auto":
            if world_size % model_parallel:
                raise ValueError(
                    f"dp='auto' needs the world size ({world_size}) to be a multiple of pp*cp*tp"
                    f" = {pp}*{cp}*{tp} = {model_parallel}. Choose pp, cp and tp whose product divides"
                    f" {world_size} (one of {_divisors(world_size)}), or change the number of devices/nodes."
                )
            dp = world_size // model_parallel
        if dp * model_parallel != world_size:
            raise ValueError(
                f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * model_parallel} does not equal the world size"
                f" {world_size} (devices x num_nodes). Set dp='auto', or sizes whose product is {world_size}."
            )
        return cls(dp=dp, pp=pp, cp=cp, tp=tp)

    @staticmethod
    def check_sizes(dp: Size, pp: int, cp: int, tp: int) -> None:
        """Each size is a positive integer (``dp`` may be ``"auto"``); needs no world size yet."""
        for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
            if name == "dp" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = " or 'auto'" if name == "dp" else ""
                raise ValueError(f"{name}={value!r} is not a valid size: use a positive integer{hint}.")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(getattr(self, name) for name in MESH_DIMS)  # type: ignore[return-value]

    dp_enabled = property(lambda self: self.dp > 1)
    pp_enabled = property(lambda self: self.pp > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    tp_enabled = property(lambda self: self.tp > 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The (pp, dp, cp, tp) coordinates of a global rank, computed without any communication."""
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in ("dp", "pp", "cp", "tp")}

    def groups(self, free: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only in the ``free`` dims, in rank order (for ``new_group`` calls,
        which every rank must make in the same order)."""
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            found.setdefault(tuple(coords[n] for n in MESH_DIMS if n not in free), []).append(rank)
        return list(found.values())

    def _group_of_each_rank(self) -> dict[str, dict[int, list[int]]]:
        """For every group name: each rank's group (one pass over the world per name)."""
        free = {"dp": ("dp",), "pp": ("pp",), "cp": ("cp",), "tp": ("tp",), "dp_cp": ("dp", "cp")}
        return {name: {rank: group for group in self.groups(free[name]) for rank in group} for name in GROUP_NAMES}

    def group_members(self, rank: int) -> dict[str, list[int]]:
        """Global ranks of every group ``rank`` belongs to, including the joint ``dp_cp`` gradient group."""
        return {name: of_rank[rank] for name, of_rank in self._group_of_each_rank().items()}

    def layout_table(self) -> str:
        """One line per rank: its coordinates and the members of its groups."""
        header = ["rank", "dp", "pp", "cp", "tp"] + [f"{g} group" for g in GROUP_NAMES]
        members = self._group_of_each_rank()
        rows = []
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            rows.append([str(rank)] + [str(coords[n]) for n in ("dp", "pp", "cp", "tp")]
                        + [",".join(map(str, members[g][rank])) for g in GROUP_NAMES])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        title = f"lightning-4d layout: dp={self.dp} pp={self.pp} cp={self.cp} tp={self.tp} (world {self.world_size})"
        return "\n".join([title, *lines])

    def build(self, device_type: str) -> ParallelMesh:
        """Every process group of the layout (a collective call: every rank builds every group in one order)."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        flat = {"dp_cp": compat.flatten_mesh(mesh, ("dp", "cp"), "dp_cp")}
        if self.pp_enabled:
            flat["pp_dp_cp"] = compat.flatten_mesh(mesh, ("pp", "dp", "cp"), "pp_dp_cp")
        return ParallelMesh(self, mesh, flat)


@dataclass
class ParallelMesh:
    """The device mesh of a layout and every process group built from it, in one place.

    Groups by name: ``dp``, ``pp``, ``cp``, ``tp`` (one dim each); ``dp_cp``, over which gradients are
    reduced (context-parallel ranks see other tokens of the same samples); under pipelining ``pp_dp_cp``,
    over which metrics sync (only the last stage updates them); ``replica`` (the ranks of one data-parallel
    replica, which must see the same batch) and ``stage`` (the ranks that hold one pipeline stage), which
    only ``debug=True`` uses: they are built on first request, which every rank makes at the same point.
    """

    dims: ParallelDims
    mesh: DeviceMesh
    flat: dict[str, DeviceMesh]
    _built: dict[object, Optional[dist.ProcessGroup]] = field(default_factory=dict)

    def group(self, name: str) -> dist.ProcessGroup:
        if name in self.flat:
            return self.flat[name].get_group()
        if name in MESH_DIMS:
            return self.mesh.get_group(name)
        if name in _SHARED_BY:
            return self._subgroup(name, self.dims.groups(_SHARED_BY[name]))
        raise KeyError(f"no process group {name!r}; groups: {', '.join((*MESH_DIMS, *self.flat, *_SHARED_BY))}")

    def _subgroup(self, key: object, ranks_per_group: list[list[int]]) -> Optional[dist.ProcessGroup]:
        """This rank's group among ``ranks_per_group``; collective the first time (every rank creates all)."""
        if key not in self._built:
            self._built[key] = dist.new_subgroups_by_enumeration(ranks_per_group)[0]
        return self._built[key]

    def local_rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    def pipeline_pair(self, first: int, last: int) -> Optional[dist.ProcessGroup]:
        """The group of pipeline ranks ``first`` and ``last`` of this rank's pipeline (None if this rank is
        neither); collective the first time: every rank asks for the same pair, in the same order."""
        if first == last:
            return None
        pipelines = self.dims.groups(("pp",))  # each in rank order, which is pipeline-rank order
        return self._subgroup(("pipeline_pair", first, last), [[p[first], p[last]] for p in pipelines])


# The ranks that must hold the same data or weights: those that differ only in these dims.
_SHARED_BY = {"replica": ("pp", "cp", "tp"), "stage": ("dp", "cp", "tp")}
