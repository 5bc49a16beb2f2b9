"""One set of weights on every rank: rank 0's whole-built parameters and buffers broadcast in bounded buckets,
and the seed a meta-built module's initialization starts from."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


# The most bytes a bucket of whole-built weights copies at once while rank 0's are broadcast: bounded, so that
# agreeing on one set of weights costs at most this much memory beyond the model, not a second copy of it; big
# enough that a bucket of small tensors (norms, biases) is one collective, not hundreds. A tensor bigger than a
# bucket that is contiguous on the device is broadcast in place, without any copy.
BROADCAST_BUCKET_BYTES = 64 * 2**20


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, device: torch.device,
                          bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Rank 0's parameters and buffers on every rank, in buckets of at most ``bucket_bytes`` per dtype (DTensors
    were placed by a parallelization that already happened, meta tensors hold no values)."""
    pending: dict[torch.dtype, tuple[list[Tensor], int]] = {}

    def send(tensors: list[Tensor]) -> None:
        if len(tensors) == 1 and tensors[0].device == device and tensors[0].is_contiguous():
            dist.broadcast(tensors[0], src=0)
            return
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
        dist.broadcast(flat, src=0)
        for t, value in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(value.view_as(t))

    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type == "meta" or isinstance(tensor, DTensor) or id(tensor) in seen or not tensor.numel():
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        bucket, used = pending.pop(tensor.dtype, ([], 0))
        if bucket and used + size > bucket_bytes:
            send(bucket)
            bucket, used = [], 0
        if size > bucket_bytes:
            send([tensor])
        else:
            bucket, used = bucket + [tensor], used + size
        if bucket:
            pending[tensor.dtype] = (bucket, used)
    for bucket, _ in pending.values():
        if bucket:
            send(bucket)


def agreed_seed(device: torch.device) -> int:
    """Rank 0's seed (``seed_everything``'s, or torch's default), the same on every rank: the base of a
    meta-built module's initialization (:mod:`lightning_4d.composition.materialize`)."""
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=0)
    return int(seed.item())
