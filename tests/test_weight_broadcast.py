"""Agreeing on rank 0's weights for a whole-built module: bounded buckets, not one flat copy of the model.

Two ranks start with different weights of three dtypes; after ``weight_agreement.broadcast_from_rank0`` with 256-byte buckets
rank 1 holds rank 0's values exactly, no broadcast message exceeds a bucket except a tensor bigger than one
(sent alone, in place: the parameter itself), and tensors of different dtypes never share a message.
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.parity import free_port, spawn

BUCKET = 256


def _module(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(16, 8), nn.LayerNorm(8), nn.Embedding(10, 8).double())
    module.register_buffer("steps", torch.randint(0, 100, (5,)))
    return module


def _worker(rank: int, world_size: int, out_dir: str, port: int) -> None:
    from lightning_4d.composition import weight_agreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        module = _module(rank)
        own = [*module.parameters(), *module.buffers()]  # two are bigger than a bucket: 512 and 640 bytes
        sent = []
        broadcast = dist.broadcast

        def recording(tensor, src, *args, **kwargs):
            sent.append((tensor.numel() * tensor.element_size(), str(tensor.dtype), any(tensor is t for t in own)))
            return broadcast(tensor, src, *args, **kwargs)

        dist.broadcast = recording
        try:
            weight_agreement.broadcast_from_rank0(module, torch.device("cpu"), bucket_bytes=BUCKET)
        finally:
            dist.broadcast = broadcast
        state = {k: v.tolist() for k, v in module.state_dict().items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"state": state, "sent": sent}, f)
    finally:
        dist.destroy_process_group()


def test_rank0_weights_reach_every_rank_in_bounded_buckets():
    results = spawn(_worker, 2, 120, free_port())
    assert results[0]["state"] == results[1]["state"]
    assert results[0]["state"] == {k: v.tolist() for k, v in _module(0).state_dict().items()}
    assert results[1]["state"] != {k: v.tolist() for k, v in _module(1).state_dict().items()}
    sent = results[1]["sent"]
    assert [size for size, _, in_place in sent if not in_place and size > BUCKET] == []
    # the two bigger than a bucket went alone, without a copy (so may a bucket that holds one tensor only)
    assert {512, 640} <= {size for size, _, in_place in sent if in_place}
    assert len(sent) >= 4 and {dtype for _, dtype, _ in sent} == {"torch.float32", "torch.float64", "torch.int64"}
