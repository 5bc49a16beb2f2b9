"""The four parallel sizes, their validation, and the device mesh built from them.

Mesh order is ``(pp, dp, cp, tp)``, innermost last. Consecutive ranks share the innermost dims, and on
a real cluster consecutive ranks share a node, so the dims that talk most get the fastest links:

* ``tp`` is innermost: it all-reduces activations in every layer, forward and backward.
* ``cp`` next: its ring passes K/V blocks in every attention layer.
* ``dp`` next: one gradient all-reduce per optimizer step, overlapped with backward.
* ``pp`` outermost: only point-to-point activations per micro-batch, the cheapest to send across nodes.

Gradients are reduced over the joint ``dp_cp`` group: context-parallel ranks see different tokens of the
same samples, so for the weights they are data parallel too.

Sharded data parallelism splits ``dp`` into ``dp_replicate x dp_shard`` (replicate outer, shard inner, so
the ranks of one shard group are neighbours): ``dp`` counts every rank that sees other samples, and a rank's
``dp`` coordinate is ``replicate * dp_shard + shard``. The device mesh has five dims,
``(pp, dp_replicate, dp_shard, cp, tp)``, with ``dp`` flattened from the two data dims.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_4d import _compat as compat

MESH_DIMS = ("pp", "dp", "cp", "tp")  # rank order of the coordinates; ``dp`` is dp_replicate x dp_shard
DEVICE_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("ep_pp", "ep_replica", "ep", "ep_tp")
GROUP_NAMES = ("dp", "pp", "cp", "tp", "dp_cp")
# ModelParallelStrategy's dimension names, answered by the same mesh (``self.device_mesh["data_parallel"]``).
LIGHTNING_MESH_DIMS = {"data_parallel": ("dp_replicate", "dp_shard"), "tensor_parallel": ("tp",)}


class _BuiltMeshes:
    """The meshes this process built, by (layout, device type, Lightning's names), for one default process group
    (see :meth:`ParallelDims.build`)."""

    world: Optional[dist.ProcessGroup] = None
    meshes: dict[tuple, "ParallelMesh"] = {}


Size = Union[int, Literal["auto"]]


def check_ep_size(ep: object) -> None:
    """``ep`` is a positive integer (needs no world size yet)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r} is not a valid size: use a positive integer (the ranks each MoE layer's"
                         " experts are split over).")


def check_ep_layout(ep: int, dp: int, cp: int) -> None:
    """``ep`` borrows its ranks from ``dp x cp`` (the ranks that see different tokens), so it must divide it."""
    check_ep_size(ep)
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp}: expert parallelism borrows its ranks"
                         " from the ranks that see different tokens (data-parallel replicas and shards, context-parallel"
                         f" ranks), never from tp or pp. Use an ep that divides {dp * cp}, or more data-parallel ranks"
                         " (devices, dp, dp_shard).")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four dims; ``dp * pp * cp * tp == world_size`` always holds once constructed.

    ``dp`` counts every data-parallel rank (each sees other samples); ``dp_shard`` of them shard the
    parameters, gradients and optimizer state among themselves (FSDP), and the ``dp // dp_shard`` groups
    of shards are replicas (:attr:`dp_replicate`; HSDP when both exceed 1).
    """

    dp: int
    pp: int
    cp: int
    tp: int
    dp_shard: int = 1
    ep: int = 1  # expert parallelism: borrowed from dp x cp (lightning_4d/expert_parallel)

    def __post_init__(self) -> None:
        if self.ep > 1:
            check_ep_layout(self.ep, self.dp, self.cp)
        if self.dp % self.dp_shard:
            raise ValueError(f"ParallelDims(dp={self.dp}, dp_shard={self.dp_shard}): dp counts every data-parallel"
                             f" rank, so it must be a multiple of dp_shard (dp = dp_replicate * dp_shard).")

    @classmethod
    def resolve(cls, world_size: int, dp: Size = "auto", pp: int = 1, cp: int = 1, tp: int = 1,
                dp_shard: Size = 1, ep: int = 1) -> ParallelDims:
        """Turn user sizes into a layout for ``world_size`` processes, or raise a ValueError that says what to change.

        ``dp`` is the number of replicas (as it always was) and ``dp_shard`` the ranks each replica's state is
        sharded over; the layout's :attr:`dp` is their product. ``dp_shard="auto"`` fills the world (then
        ``dp="auto"`` means one replica); otherwise ``dp="auto"`` does.
        """
        cls.check_sizes(dp, pp, cp, tp, dp_shard)
        check_ep_size(ep)
        dims = cls._resolve(world_size, dp, pp, cp, tp, dp_shard)
        return dims if ep == 1 else cls(dims.dp, dims.pp, dims.cp, dims.tp, dims.dp_shard, ep)

    @classmethod
    def _resolve(cls, world_size: int, dp: Size, pp: int, cp: int, tp: int, dp_shard: Size) -> ParallelDims:
        if dp_shard == "auto":
            replicas = 1 if dp == "auto" else dp
            rest = replicas * pp * cp * tp
            if world_size % rest:
                raise ValueError(
                    f"dp_shard='auto' needs the world size ({world_size}) to be a multiple of dp*pp*cp*tp"
                    f" = {replicas}*{pp}*{cp}*{tp} = {rest}. Choose sizes whose product divides {world_size}"
                    f" (one of {_divisors(world_size)}), or change the number of devices/nodes."
                )
            return cls(dp=replicas * (world_size // rest), pp=pp, cp=cp, tp=tp, dp_shard=world_size // rest)
        model_parallel = pp * cp * tp * dp_shard
        if dp == "auto":
            if world_size % model_parallel:
                what = "pp*cp*tp" + ("*dp_shard" if dp_shard > 1 else "")
                sizes = f"{pp}*{cp}*{tp}" + (f"*{dp_shard}" if dp_shard > 1 else "")
                raise ValueError(
                    f"dp='auto' needs the world size ({world_size}) to be a multiple of {what}"
                    f" = {sizes} = {model_parallel}. Choose sizes whose product divides"
                    f" {world_size} (one of {_divisors(world_size)}), or change the number of devices/nodes."
                )
            dp = world_size // model_parallel
        if dp_shard > 1 and dp * model_parallel != world_size:
            raise ValueError(
                f"dp*dp_shard*pp*cp*tp = {dp}*{dp_shard}*{pp}*{cp}*{tp} = {dp * model_parallel} does not equal the"
                f" world size {world_size} (devices x num_nodes). Set dp='auto' or dp_shard='auto', or sizes whose"
                f" product is {world_size}."
            )
        if dp * model_parallel != world_size:
            raise ValueError(
                f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * model_parallel} does not equal the world size"
                f" {world_size} (devices x num_nodes). Set dp='auto', or sizes whose product is {world_size}."
            )
        return cls(dp=dp * dp_shard, pp=pp, cp=cp, tp=tp, dp_shard=dp_shard)

    @staticmethod
    def check_sizes(dp: Size, pp: int, cp: int, tp: int, dp_shard: Size = 1) -> None:
        """Each size is a positive integer (``dp`` and ``dp_shard`` may be ``"auto"``); needs no world size yet."""
        for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp), ("dp_shard", dp_shard)):
            if name in ("dp", "dp_shard") and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = " or 'auto'" if name in ("dp", "dp_shard") else ""
                raise ValueError(f"{name}={value!r} is not a valid size: use a positive integer{hint}.")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(getattr(self, name) for name in MESH_DIMS)  # type: ignore[return-value]

    @property
    def dp_replicate(self) -> int:
        """Replicas of the (sharded) state: ``dp // dp_shard``."""
        return self.dp // self.dp_shard

    dp_enabled = property(lambda self: self.dp > 1)
    ep_enabled = property(lambda self: self.ep > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard > 1)
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
        names = GROUP_NAMES + (("dp_shard_cp",) if self.dp_shard_enabled else ()) + (
            ("ep", "ep_replica") if self.ep_enabled else ())
        header = ["rank", "dp", "pp", "cp", "tp"] + [f"{g} group" for g in names]
        members = self._group_of_each_rank()
        if self.ep_enabled:  # the expert mesh's groups: (pp, ep_replica, ep, tp), see _expert_mesh
            ranks = torch.arange(self.world_size).view(self.pp, self.dp * self.cp // self.ep, self.ep, self.tp)
            for name, dim in (("ep", 2), ("ep_replica", 1)):
                groups = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
                members[name] = {rank: group for group in groups for rank in group}
        if self.dp_shard_enabled:  # the ranks that shard one copy of the state: same replica, pp and tp
            members["dp_shard_cp"] = {rank: [r for r in members["dp_cp"][rank]
                                             if self._replica_index(r) == self._replica_index(rank)]
                                      for rank in range(self.world_size)}
        rows = []
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            rows.append([str(rank)] + [str(coords[n]) for n in ("dp", "pp", "cp", "tp")]
                        + [",".join(map(str, members[g][rank])) for g in names])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        dp = f"{self.dp} (dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard})" if self.dp_shard_enabled \
            else str(self.dp)
        ep = f" ep={self.ep} (from dp x cp)" if self.ep_enabled else ""
        title = f"lightning-4d layout: dp={dp} pp={self.pp} cp={self.cp} tp={self.tp}{ep} (world {self.world_size})"
        return "\n".join([title, *lines])

    def _replica_index(self, rank: int) -> int:
        return self.coordinates(rank)["dp"] // self.dp_shard

    def build(self, device_type: str, lightning_names: bool = False) -> ParallelMesh:
        """Every process group of the layout (a collective call: every rank builds every group in one order).
        ``lightning_names``: the mesh also answers ModelParallelStrategy's ``data_parallel`` and ``tensor_parallel``
        (for a module whose ``configure_model`` slices them); each is one more process group to create.

        A process builds a layout once per default process group and hands the same mesh to every later
        ``fit``, ``validate``, ``test`` or ``predict`` (and Trainer) with that layout: new groups each time would
        each keep their threads and sockets (gloo) or communicators and device buffers (NCCL) until the process
        exits. Every rank runs the same entry points in the same order, so all of them build or all reuse."""
        if _BuiltMeshes.world is not dist.group.WORLD:  # a new default group (the old one was destroyed)
            _BuiltMeshes.world, _BuiltMeshes.meshes = dist.group.WORLD, {}
        key = (self, device_type, lightning_names)
        if key not in _BuiltMeshes.meshes:
            _BuiltMeshes.meshes[key] = self._build(device_type, lightning_names)
        return _BuiltMeshes.meshes[key]

    def _build(self, device_type: str, lightning_names: bool) -> ParallelMesh:
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DEVICE_MESH_DIMS)
        flat = {"dp": compat.flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp"),
                "dp_cp": compat.flatten_mesh(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")}
        # Lightning's ModelParallelStrategy names: a module written for it slices them in configure_model.
        for name, dims in LIGHTNING_MESH_DIMS.items() if lightning_names else ():
            flat[name] = compat.flatten_mesh(mesh, dims, name)
        if self.dp_shard_enabled:
            flat["dp_shard_cp"] = compat.flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        if self.pp_enabled:
            flat["pp_dp_cp"] = compat.flatten_mesh(mesh, ("pp", "dp_replicate", "dp_shard", "cp"), "pp_dp_cp")
        return ParallelMesh(self, mesh, flat, self._expert_mesh(device_type) if self.ep_enabled else None)

    def _expert_mesh(self, device_type: str) -> DeviceMesh:
        """``(pp, ep_replica, ep, tp)``: the ``dp x cp`` coordinate cut into consecutive blocks of ``ep`` ranks
        (an expert group), ``ep_replica`` the ranks at one position of every block (they hold the same experts)."""
        ranks = torch.arange(self.world_size).view(self.pp, self.dp * self.cp // self.ep, self.ep, self.tp)
        return DeviceMesh(device_type, ranks, mesh_dim_names=EXPERT_MESH_DIMS)


@dataclass
class ParallelMesh:
    """The device mesh of a layout and every process group built from it, in one place.

    Groups by name: ``dp`` (every data-parallel rank), ``pp``, ``cp``, ``tp``, ``dp_replicate``, ``dp_shard``;
    ``dp_cp``, over which gradients are reduced (context-parallel ranks see other tokens of the same samples);
    with ``dp_shard > 1`` ``dp_shard_cp``, over which FSDP shards the state; under pipelining ``pp_dp_cp``,
    over which metrics sync (only the last stage updates them); ``replica`` (the ranks of one data-parallel
    replica, which must see the same batch) and ``stage`` (the ranks that hold one pipeline stage), which
    only ``debug=True`` uses: they are built on first request, which every rank makes at the same point.
    """

    dims: ParallelDims
    mesh: DeviceMesh
    flat: dict[str, DeviceMesh]
    experts: Optional[DeviceMesh] = None  # ``(pp, ep_replica, ep, tp)`` when ep > 1
    _built: dict[object, Optional[dist.ProcessGroup]] = field(default_factory=dict)

    def group(self, name: str) -> dist.ProcessGroup:
        if name in ("ep", "ep_replica") and self.experts is not None:
            return self.experts.get_group(name)
        if name in self.flat:
            return self.flat[name].get_group()
        if name in DEVICE_MESH_DIMS:
            return self.mesh.get_group(name)
        if name in _SHARED_BY:
            return self._subgroup(name, self.dims.groups(_SHARED_BY[name]))
        raise KeyError(f"no process group {name!r}; groups: {', '.join((*DEVICE_MESH_DIMS, *self.flat, *_SHARED_BY))}")

    def sampler_kwargs(self) -> dict[str, int]:
        """``DistributedSampler``'s ``num_replicas`` and ``rank``: only the data-parallel ranks (replicas and
        shards) get different samples; pp, cp and tp peers must see the same batch."""
        dp_mesh = self.submesh("dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def submesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one dim, flattened (``dp``, ``dp_cp``, ...) or not (``tp``, ...)."""
        return self.flat[name] if name in self.flat else self.mesh[name]

    def sharding_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: ``dp_shard x cp`` (1-D), or ``(dp_replicate, dp_shard x cp)`` for HSDP."""
        if self.dims.dp_replicate == 1:
            return self.flat["dp_shard_cp"]
        return compat.mesh_with_flattened(self.mesh, ("dp_replicate", "dp_shard_cp"))

    def _subgroup(self, key: object, ranks_per_group: list[list[int]]) -> Optional[dist.ProcessGroup]:
        """This rank's group among ``ranks_per_group``; collective the first time (every rank creates all)."""
        if key not in self._built:
            self._built[key] = dist.new_subgroups_by_enumeration(ranks_per_group)[0]
        return self._built[key]

    def local_rank(self, dim: str) -> int:
        return self.submesh(dim).get_local_rank()

    def pipeline_pair(self, first: int, last: int) -> Optional[dist.ProcessGroup]:
        """The group of pipeline ranks ``first`` and ``last`` of this rank's pipeline (None if this rank is
        neither); collective the first time: every rank asks for the same pair, in the same order."""
        if first == last:
            return None
        pipelines = self.dims.groups(("pp",))  # each in rank order, which is pipeline-rank order
        return self._subgroup(("pipeline_pair", first, last), [[p[first], p[last]] for p in pipelines])


# The ranks that must hold the same data or weights: those that differ only in these dims.
_SHARED_BY = {"replica": ("pp", "cp", "tp"), "stage": ("dp", "cp", "tp")}


# The keys this run of the process groups keeps in the rendezvous store, apart from those of the runs before it.
#
# Under ``torchrun --max-restarts`` the agent hosts the store and keeps it when it restarts the ranks (they connect
# to the same port again), so what a killed attempt wrote is still there when the next one starts. Read back, it
# is wrong: a peer's last heartbeat record says it "left: failed" (a rank of the new attempt, waiting for a peer
# that is only slow to start, would exit blaming itself), the first-failure slot is taken (a failure of the new
# attempt would be reported as the old one), a pipeline stage would read another step's result structure.
#
# So global rank 0 names each run with a fresh random name as the strategy sets its environment up, with
# ``layout="auto"`` too (:func:`begin_run_keys`), before the ranks' first barrier (Lightning's ``pre_setup``
# barrier, before any callback's ``setup``); everything the package keeps in the store goes under that name
# (:func:`run_scoped_store`), looked up after that barrier, so every rank of a run uses the same name and none an earlier run's. A store that no strategy named (a
# test's own store) is used as it is. (torch's own keys, the process group's connection addresses, are not ours to
# move: docs/checkpoints.md, "Automatic restarts", says how to give each attempt a store of its own.)
RUN_KEY = "lightning_4d/run"  # this run's name, written by global rank 0
_RUN_PREFIX = "lightning_4d/runs/"


def begin_run_keys() -> None:
    """On global rank 0, once the default process group exists and before any barrier: a new name for this run's
    keys in the rendezvous store. Every rank calls it; the others have nothing to do."""
    store = compat.default_store()
    if store is not None and dist.get_rank() == 0:
        store.set(RUN_KEY, uuid.uuid4().hex)


def run_scoped_store(store: Optional[dist.Store]) -> Optional[dist.Store]:
    """``store`` with every key under the name of the run that :func:`begin_run_keys` started (``store`` itself
    when it has none, or cannot be reached: its host is gone, and the caller's own error handling takes over)."""
    if store is None:
        return None
    try:
        if not store.check([RUN_KEY]):
            return store
        name = store.get(RUN_KEY).decode()
    except Exception:  # noqa: BLE001  the store's host (rank 0) is gone
        return store
    return dist.PrefixStore(_RUN_PREFIX + name, store)
