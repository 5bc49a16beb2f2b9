"""Models built on the meta device: allocate only what this rank holds, then fill it with the module's own
initializer.

A module built under ``trainer.init_module(empty_init=True)`` (``torch.device("meta")``), on the meta device in
``configure_model``, or handed over with meta parameters has shapes but no values. The composition decides its
plans, the pipeline cut, the tensor-parallel placements and the FSDP units on those shapes alone; then:

1. :func:`check_initializers` (pure, the same on every rank, before any collective): every meta tensor must have
   something that fills it, else a ValueError names the modules and the fixes. A tensor is filled by the
   module's own initializer: Hugging Face's ``_init_weights`` (the ``post_init`` path) for modules of a
   ``PreTrainedModel``, torchtitan's ``init_weights``/``init_states`` of a module that defines one (it covers
   its whole subtree), or the module's ``reset_parameters()``. With ``loading`` (``init_from``, strict), the
   load fills parameters and persistent buffers; only non-persistent buffers (rotary ``inv_freq``, cos/sin
   caches), which no checkpoint holds, still need an initializer.
2. :func:`materialize`: each meta parameter gets storage of its local size (a tensor-parallel shard, an FSDP
   shard, a pipeline stage's blocks only) in place: the same Parameter object, its hooks and attributes kept.
   Tensors that already had storage (pipeline stand-ins, buffers built on a real device) are left alone.
   Floating-point storage starts as NaN, so that anything an initializer misses is loud, not plausible garbage.
3. :func:`initialize`: the initializers run on what this rank holds, under ``no_grad``, with the global random
   state restored afterwards. Non-persistent buffers are always recomputed, never left as ``torch.empty``'s
   garbage.

What the values are: every random fill of a parameter or buffer is seeded by (the seed agreed with rank 0, the
tensor's name, which shard of it this rank holds, how many fills it had before). So every rank holding the same
shard (data-parallel replicas, tensor-parallel ranks of a replicated tensor, context-parallel ranks) draws the
same values, and different shards of one tensor draw independent ones: drawn from the initializer's own
distribution (its fan-in and std computed on the global shape), but not the numbers one process would draw
from the same seed, and they differ between layouts. For the numbers of a given model, load them
(``init_from``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_4d import _compat as compat


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no values)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """``module``'s own (name, tensor, is a parameter), not its children's."""
    for name, p in compat.parameters_of(module).items():
        if p is not None:
            yield name, p, True
    for name, b in compat.buffers_of(module).items():
        if b is not None:
            yield name, b, False


def _titan_initializer(module: nn.Module) -> Optional[str]:
    """The name of a torchtitan-style initializer the class of ``module`` defines (``init_weights`` or
    ``init_states``), or None. Hugging Face models have an ``init_weights`` of their own: they go by
    ``_init_weights``."""
    if compat.hf_pretrained(module):
        return None
    for name in ("init_weights", "init_states"):
        if callable(getattr(type(module), name, None)):
            return name
    return None


class Initializers:
    """Who fills each module's tensors: its nearest Hugging Face ``PreTrainedModel``, the outermost module above
    it with a torchtitan ``init_weights``/``init_states``, or its own ``reset_parameters``."""

    def __init__(self, root: nn.Module) -> None:
        self.hf_owner: dict[int, nn.Module] = {}
        self.titan_roots: list[tuple[str, nn.Module, str]] = []
        self.under_titan: set[int] = set()

        def walk(name: str, module: nn.Module, hf: Optional[nn.Module], titan: bool) -> None:
            if compat.hf_pretrained(module):
                hf = module
            if not titan and hf is None and _titan_initializer(module) is not None:
                self.titan_roots.append((name, module, _titan_initializer(module)))
                titan = True
            if hf is not None:
                self.hf_owner[id(module)] = hf
            if titan:
                self.under_titan.add(id(module))
            for child_name, child in compat.children_of(module).items():
                if child is not None:
                    walk(f"{name}.{child_name}" if name else child_name, child, hf, titan)

        walk("", root, None, False)

    def covers(self, module: nn.Module) -> bool:
        return (id(module) in self.hf_owner or id(module) in self.under_titan
                or callable(getattr(module, "reset_parameters", None)))


def check_initializers(module: nn.Module, loading: bool = False) -> None:
    """Refuse a meta-built ``module`` whose meta tensors nothing would fill (pure: raises the same ValueError on
    every rank, before any collective). ``loading``: a strict load of every parameter and persistent buffer
    follows (``init_from``)."""
    initializers = Initializers(module)
    covered: set[int] = set()
    needed: list[tuple[str, nn.Module, str, Tensor, bool]] = []
    for fqn, m in module.named_modules():
        transient = compat.non_persistent_buffers(m)
        for name, tensor, is_param in _own_tensors(m):
            if not tensor.is_meta:
                continue
            if initializers.covers(m):
                covered.add(id(tensor))
            if loading and (is_param or name not in transient):
                continue  # the load fills it
            needed.append((fqn, m, name, tensor, name in transient))
    missing: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    transient_only = True
    for fqn, m, name, tensor, transient in needed:
        if id(tensor) in covered:
            continue
        missing.setdefault(fqn or "(the module itself)", []).append(name)
        kinds[fqn or "(the module itself)"] = type(m).__name__
        transient_only = transient_only and transient
    if not missing:
        return
    listed = "; ".join(f"{fqn} ({kinds[fqn]}: {', '.join(names)})" for fqn, names in missing.items())
    if transient_only:
        raise ValueError(
            f"The model was built on the meta device (shapes, no values) and these modules hold non-persistent"
            f" buffers that nothing can recompute: {listed}. No checkpoint holds such a buffer (init_from cannot"
            " fill it), and each rank fills what it holds with the module's own initializer, which these modules"
            " lack. Fix: give each a reset_parameters() that recomputes its buffers, or create the buffers on a"
            " real device (e.g. torch.arange(..., device='cpu')) or build the model without the meta device.")
    raise ValueError(
        f"The model was built on the meta device (shapes, no values) and these modules hold parameters or buffers"
        f" that nothing can initialize: {listed}. Each rank allocates only the shards it holds and fills them with"
        " the module's own initializer (reset_parameters(), Hugging Face's _init_weights, torchtitan's"
        " init_weights/init_states), which these modules lack; FourDStrategy never trains on uninitialized memory."
        " Fix: give each of these modules a reset_parameters() that fills its tensors, or load the weights with"
        " FourDStrategy(init_from=PATH) (a checkpoint directory, a Lightning checkpoint or a state_dict file), or"
        " build the model without the meta device.")


def _unfilled(tensor: Tensor, device: torch.device) -> Tensor:
    """Storage for a meta tensor's local part: NaN for floating point (what an initializer missed shows as NaN
    in the first loss, not as plausible garbage), else uninitialized."""
    empty = torch.empty_like(tensor, device=device)
    if empty.is_floating_point() or empty.is_complex():
        empty.fill_(float("nan"))
    return empty


def _swap_in_place(param: nn.Parameter, device: torch.device) -> None:
    """Give a meta parameter storage of its local size, keeping the object (references held by the pipeline,
    FSDP, optimizers later), its attributes and its hooks."""
    attributes = dict(param.__dict__)
    hooks = compat.tensor_hooks(param)
    fresh = nn.Parameter(_unfilled(param, device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, fresh)
    for key, value in attributes.items():
        param.__dict__.setdefault(key, value)
    compat.set_tensor_hooks(param, hooks)


def materialize(module: nn.Module, device: torch.device) -> list[tuple[str, nn.Module, set[str]]]:
    """Storage for every meta parameter and buffer of ``module`` on ``device``, of the size this rank holds
    (DTensors get their local shard); returns (name, module, the names of its tensors that were meta) of each
    module that had one. Nothing else is touched; no communication."""
    from torch.distributed.fsdp import FSDPModule

    owners: list[tuple[str, nn.Module, set[str]]] = []
    done: dict[int, Tensor] = {}
    for fqn, m in module.named_modules():
        names: set[str] = set()
        params, buffers = compat.parameters_of(m), compat.buffers_of(m)
        for name, tensor, is_param in list(_own_tensors(m)):
            if id(tensor) in done:
                if not is_param:
                    buffers[name] = done[id(tensor)]
                names.add(name)
                continue
            if not tensor.is_meta:
                continue
            if is_param:
                _swap_in_place(params[name], device)
                done[id(tensor)] = tensor
            else:
                buffers[name] = done[id(tensor)] = _unfilled(tensor, device)
            names.add(name)
        if names:
            owners.append((fqn, m, names))
    for m in module.modules():
        if isinstance(m, FSDPModule):
            compat.fsdp_reset_sharded_params(m)
    return owners


def _stable_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _storage_key(tensor: Tensor) -> Optional[int]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0 or local.is_meta:
        return None
    return local.untyped_storage().data_ptr()


def shard_key(tensor: Tensor) -> tuple[int, ...]:
    """Which shard of ``tensor`` this rank holds: its coordinate on each mesh dimension that shards it (ranks
    holding the same shard get the same key); () for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return ()
    coordinate = tensor.device_mesh.get_coordinate() or []
    return tuple(c if placement.is_shard() or "Shard" in type(placement).__name__ else 0
                 for c, placement in zip(coordinate, tensor.placements))


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


def _shard_seeds(seed: int, names: dict[int, str]) -> Any:
    """A dispatch mode in which every in-place random fill of a known tensor (a parameter or buffer, by its
    storage) is seeded by (``seed``, its name, this rank's shard of it, its fill count), and a DTensor's fill
    runs on its local shard: shards of one tensor independent, replicas identical, no DTensor RNG collective."""

    class ShardSeeds(compat.dispatch_mode()):
        def __init__(self) -> None:
            super().__init__()
            self.fills: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            target = args[0] if args and isinstance(args[0], Tensor) else None
            if (target is None or torch.Tag.nondeterministic_seeded not in func.tags
                    or not func.overloadpacket.__name__.endswith("_")):
                return func(*args, **kwargs)
            name = names.get(_storage_key(target))
            if name is None:
                return func(*args, **kwargs)
            count = self.fills.get(name, 0)
            self.fills[name] = count + 1
            local = target.to_local() if isinstance(target, DTensor) else target
            with _seeded(_stable_seed(seed, name, shard_key(target), count), local.device):
                func(local, *args[1:], **kwargs)
            return target

    return ShardSeeds()


@torch.no_grad()
def initialize(module: nn.Module, owners: list[tuple[str, nn.Module, set[str]]], device: torch.device, seed: int,
               loading: bool = False) -> None:
    """Run the initializers of the modules :func:`materialize` gave storage (``owners``), on what this rank
    holds (see the module docstring for the values). ``loading``: only modules with non-persistent buffers
    (a load fills the rest). The global random state is the same afterwards as before."""
    initializers = Initializers(module)
    todo = [(fqn, m) for fqn, m, names in owners
            if not loading or names & compat.non_persistent_buffers(m)]
    if not todo:
        return
    names: dict[int, str] = {}
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        key = _storage_key(tensor)
        if key is not None:
            names.setdefault(key, name)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), \
            _shard_seeds(seed, names):
        for fqn, m in todo:
            if id(m) in initializers.under_titan:
                continue
            torch.manual_seed(_stable_seed(seed, fqn))
            try:
                owner = initializers.hf_owner.get(id(m))
                if owner is not None:
                    compat.hf_initialize_module(owner, m)
                else:
                    m.reset_parameters()
            except Exception as error:
                raise RuntimeError(f"Initializing {fqn or type(m).__name__} ({type(m).__name__}) on the shards this"
                                   f" rank holds failed: {type(error).__name__}: {error}. Fix: an initializer that"
                                   " works on DTensor shards, or init_from=PATH.") from error
        held = {id(m) for _, m in todo}
        for fqn, root, method in initializers.titan_roots:
            if not any(id(m) in held for m in root.modules()):
                continue
            torch.manual_seed(_stable_seed(seed, fqn))
            function = getattr(root, method)
            try:
                function(buffer_device=device)
            except TypeError:
                function()


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for a module with meta tensors, which torch refuses ("Cannot copy out of meta
    tensor"): the tensors with values move, the meta ones wait for :func:`materialize`."""
    for m in module.modules():
        buffers = compat.buffers_of(m)
        for name, tensor, is_param in list(_own_tensors(m)):
            if tensor.is_meta or tensor.device == device:
                continue
            if is_param:
                tensor.data = tensor.data.to(device)
            else:
                buffers[name] = tensor.to(device)
