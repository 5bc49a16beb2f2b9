"""Ring attention's masked tiles on a GPU: one process (a cp group of one), every mask kind, fp32 and bf16,
against ``F.scaled_dot_product_attention`` with the mask written out; prints the largest errors and the time.

    python bench/gpu_masked_attention.py

The CPU test suite runs the masked tiles on CPU kernels only. On CUDA a tile at a mask's edge runs on the math
kernel and a whole tile on the fused flash or memory-efficient kernel, and the two are merged by log-sum-exp:
this checks that path where a GPU is lent (a group of one rank: the kernels and the merge, not the exchange).
"""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_4d.context_parallel.ring_attention import ring_attention  # noqa: E402
from lightning_4d.context_parallel.sequence_mask import SequenceMask  # noqa: E402


def masks(batch: int, length: int, device: torch.device) -> dict[str, SequenceMask]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 3, length + 1, (batch,), generator=generator)
    valid = (torch.arange(length) < lengths[:, None]).to(device)
    starts = torch.rand(batch, length, generator=generator) < 0.01
    starts[:, 0] = True
    documents = starts.long().cumsum(1).to(device)
    return {"padding": SequenceMask(True, key_valid=valid), "window": SequenceMask(True, window=length // 8),
            "documents": SequenceMask(True, documents=documents),
            "window+padding": SequenceMask(True, window=length // 8, key_valid=valid),
            "bidirectional+padding": SequenceMask(False, key_valid=valid)}


def main() -> None:
    device = torch.device("cuda")
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    batch, heads, kv_heads, length, head_dim = 2, 8, 4, 2048, 64
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for name, mask in masks(batch, length, device).items():
            q, k, v, dout = (torch.randn(batch, h, length, head_dim, device=device, dtype=dtype)
                             for h in (heads, kv_heads, kv_heads, heads))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            whole = torch.arange(length, device=device)
            dense = mask.between(whole, whole)
            ref = [t.double().detach().requires_grad_() for t in (q, k, v)]
            expected = F.scaled_dot_product_attention(*ref, attn_mask=dense, enable_gqa=True)
            expected.backward(dout.double())
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = ring_attention(*leaves, group=None, mask=mask)
            out.backward(dout)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            errors = {n: float((got.detach().double() - want).abs().max() / want.abs().max().clamp_min(1e-12))
                      for n, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)),
                                              (expected, *(t.grad for t in ref)))}
            results["cases"][f"{name}-{str(dtype).split('.')[-1]}"] = {"relative_error": errors, "seconds": elapsed}
            print(f"{name:24s} {str(dtype):15s} max relative error {max(errors.values()):.2e}  {elapsed * 1e3:.1f} ms",
                  flush=True)
    dist.destroy_process_group()
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    with open(os.path.join(out_dir, "gpu_masked_attention.json"), "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
