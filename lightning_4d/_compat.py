"""Every private (``_``-prefixed) torch or Lightning name lightning-4d reaches, one alias or function each, so
that a rename in a new release breaks here, in one place, with a clear name."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


def default_store() -> Optional[dist.Store]:
    """The store of the default process group (the rendezvous TCPStore); None without a process group.
    torch keeps it private (``distributed_c10d._get_default_store``); lightning-4d reads and writes small keys in
    it (first failure, heartbeats) beside the collectives."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
