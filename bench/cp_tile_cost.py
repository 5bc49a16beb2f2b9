"""What one tile pair of ring attention costs, forward and backward, when it runs whole and when it runs with a
document mask: the weights the document-balanced layout deals pieces by
(:data:`lightning_4d.context_parallel.document_layout.WHOLE_COST` and ``MASKED_COST``).

    OMP_NUM_THREADS=1 python bench/cp_tile_cost.py [--tile 256 512] [--pieces 8] [--heads 4] [--head-dim 64]
                                                   [--iters 5] [--name cp_tile_cost]

One process (a gloo group of one) runs ring attention, forward and backward, over ``pieces`` tiles of ``tile``
tokens in the document layout under several packings of documents (one document; documents of 1, 2 and 4 tiles,
aligned with the tiles or shifted by half a tile; a mix): each packing makes the ring compute a different number
of whole and of masked tile pairs (counted by :func:`~lightning_4d.context_parallel.ring_attention.tile_work`).
CPU time, the best of ``--iters``, is fitted by least squares as ``fixed + whole * pairs_whole + masked *
pairs_masked``; the result is the two per-pair costs and their ratio, which the layout's weights should match.
Results go to ``bench/results/NAME.json``.
"""

import argparse
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import command, write  # noqa: E402
from lightning_4d.context_parallel.document_layout import MASKED_COST, WHOLE_COST, SequenceLayout  # noqa: E402
from lightning_4d.context_parallel.ring_attention import ring_attention, tile_work  # noqa: E402
from lightning_4d.context_parallel.sequence_mask import SequenceMask  # noqa: E402


def packings(tile: int, pieces: int) -> dict[str, list[int]]:
    """Document lengths that fill ``pieces`` tiles of ``tile`` tokens, by name."""
    length = tile * pieces
    half = tile // 2
    mixed = [3 * half, tile, 5 * half, half]
    return {
        "one document": [length],
        "1 tile each": [tile] * pieces,
        "2 tiles each": [2 * tile] * (pieces // 2),
        "4 tiles each": [4 * tile] * (pieces // 4),
        "1 tile, shifted": [half] + [tile] * (pieces - 1) + [half],
        "2 tiles, shifted": [half] + [2 * tile] * (pieces // 2 - 1) + [tile + half],
        "mixed": [*mixed, length - sum(mixed)],
    }


def measure(lengths: list[int], tile: int, pieces: int, args: argparse.Namespace) -> dict:
    length = tile * pieces
    if sum(lengths) != length or min(lengths) <= 0:
        raise SystemExit(f"document lengths {lengths} do not fill {length} tokens")
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    mask = SequenceMask(causal=True, documents=documents,
                        layout=SequenceLayout(torch.arange(length).unsqueeze(0), pieces))
    whole, masked = tile_work(mask, length, 1, 0)
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, args.heads, length, args.head_dim, generator=generator) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ring_attention(q, k, v, group=None, mask=mask).backward(dout)  # warm-up
    cpu = []
    for _ in range(args.iters):
        q.grad = k.grad = v.grad = None
        start = time.process_time()
        ring_attention(q, k, v, group=None, mask=mask).backward(dout)
        cpu.append(time.process_time() - start)
    return {"pairs_whole": whole // tile**2, "pairs_masked": masked // tile**2, "cpu_s": min(cpu)}


def fit(rows: list[dict]) -> dict:
    """Least squares of CPU time on (1, whole pairs, masked pairs)."""
    design = torch.tensor([[1.0, row["pairs_whole"], row["pairs_masked"]] for row in rows], dtype=torch.float64)
    seconds = torch.tensor([[row["cpu_s"]] for row in rows], dtype=torch.float64)
    fixed, whole, masked = torch.linalg.lstsq(design, seconds).solution.flatten().tolist()
    residual = (design @ torch.tensor([[fixed], [whole], [masked]], dtype=torch.float64) - seconds).abs().max()
    return {"fixed_ms": fixed * 1e3, "whole_pair_ms": whole * 1e3, "masked_pair_ms": masked * 1e3,
            "masked_vs_whole": masked / whole, "largest_residual_ms": float(residual) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tile", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--pieces", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--name", default="cp_tile_cost")
    args = parser.parse_args()
    if args.pieces % 4 or args.pieces < 8:
        raise SystemExit(f"--pieces {args.pieces}: the packings need a multiple of 4, at least 8")
    torch.set_num_threads(1)
    # a group of one in its own in-memory store: no port to find or collide on
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=600))
    results = []
    for tile in args.tile:
        rows = [{"packing": name, **measure(lengths, tile, args.pieces, args)}
                for name, lengths in packings(tile, args.pieces).items()]
        results.append({"tile": tile, "rows": rows, **fit(rows)})
        print(f"tile {tile}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[-1].items() if k not in ("tile", "rows")))
        for row in rows:
            print(f"  {row['packing']:18s} whole {row['pairs_whole']:3d} masked {row['pairs_masked']:3d} "
                  f"cpu {row['cpu_s'] * 1e3:8.2f} ms")
    dist.destroy_process_group()
    payload = {"command": command("cp_tile_cost.py"), "heads": args.heads, "head_dim": args.head_dim,
               "pieces": args.pieces, "iters": args.iters, "weights_in_use": [WHOLE_COST, MASKED_COST],
               "results": results}
    print(f"(written to {write(args.name, payload)})")


if __name__ == "__main__":
    main()
