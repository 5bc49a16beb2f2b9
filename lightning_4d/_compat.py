"""Every private name of torch, Lightning and torchmetrics that lightning-4d reaches, in one place.

A private name can change or vanish in any release without a deprecation. Reaching each one only through
this module means an upgrade breaks here, in one file, and ``tests/test_compat.py`` fails naming the symbol
instead of a parallel run going wrong somewhere else. Each entry says why no public API does the job.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """One mesh dim made of several (``dp`` and ``cp`` for the gradient group). DeviceMesh has no public way to
    join dims; the object returned must be kept (looking a flattened name up from the root is deprecated)."""
    return mesh[dims]._flatten(name)


def default_store() -> dist.Store:
    """The rendezvous store of the default process group: a side channel that works while collectives hang
    or fail (desync checks, first-failure reports). torch exposes it only privately."""
    return dist.distributed_c10d._get_default_store()
