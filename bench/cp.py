"""Context-parallel attention over a sweep of sequence lengths: peak memory per rank and time, against one
process.

    OMP_NUM_THREADS=1 python bench/cp.py [--seq 16384 ...] [--cp 4 ...] [--variants single ring allgather a2a]
                                         [--mask causal|window|packed] [--window 1024] [--documents equal|mixed]
                                         [--layout zigzag balanced] [--heads 4] [--head-dim 64] [--iters 2]
                                         [--name cp]

For every ``--seq``, one attention call, forward and backward, over that many tokens
([1, heads, seq, head_dim], fp32): computed by one process with ``F.scaled_dot_product_attention``, and for
every ``--cp`` by that many processes (gloo) each holding ``seq / cp`` tokens with ring attention,
``comm="ring"`` and ``comm="allgather"``, or with Ulysses (``a2a``). The mask is causal, or a causal sliding
``--window``, or packed documents (``--documents equal``: all of ``--window`` tokens; ``mixed``: lengths drawn
from 1/16 to 4 times that, seeded), given to one process written out and to the others as a ``SequenceMask``.
Packed documents can be laid out over the ranks by ``--layout``: the zigzag split, or the document-balanced one
(:mod:`lightning_4d.context_parallel.document_layout`). Every variant runs in fresh processes. Results go to
``bench/results/NAME.json``; each row also has the slowest and the fastest rank's CPU time, whose ratio is the
load imbalance of the layout under the mask, and the attention work each rank's ring computes (query x key
elements of its tile pairs, those it runs with a mask weighed as the layout weighs them), the same imbalance
counted exactly.

Memory is the peak of tensor storage alive at once on a rank during one forward+backward, counted by a
dispatch mode from the inputs on (q, k, v and the output gradient, the output, log-sum-exp, gradients,
communication buffers and every intermediate tensor). CPU torch has no allocator statistics, and resident
set size depends on how glibc happened to reuse freed memory (the same run measured 20 or 38 blocks
depending on what the process had imported), so storage is counted directly; scratch memory a kernel
allocates and frees inside one call is not seen, in either variant. Time is the best of ``--iters`` untracked
runs: wall time (the slowest rank) and CPU time per rank. Ranks share the machine's cores, so with fewer
cores than ranks wall time shows the total work more than the split; CPU time per rank shows the split.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from bench.common import command, write  # noqa: E402
from bench.report import table  # noqa: E402
from lightning_4d.context_parallel.document_layout import MASKED_COST, WHOLE_COST, balanced_layout  # noqa: E402
from lightning_4d.context_parallel.ring_attention import ring_attention, tile_work  # noqa: E402
from lightning_4d.context_parallel.sequence_mask import SequenceMask  # noqa: E402
from lightning_4d.context_parallel.ulysses import ulysses_attention  # noqa: E402

VARIANTS = ("single", "ring", "allgather", "a2a")
MASKS = ("causal", "window", "packed")
LAYOUTS = ("zigzag", "balanced")
TIMEOUT_S = 900


class LiveStorage(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once, over the storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked: set[int] = set()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._tracked or size == 0:
            return
        self._tracked.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        # Storages keep their Python object while alive, so this runs when the memory itself is freed.
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._tracked.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


def worker(variant: str, rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))

    mask = sequence_mask(args, args.seq)
    layout = args.layout[0]

    def attend(q, k, v):
        length = q.size(2) * world
        if variant == "single":
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            whole = torch.arange(length)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sized(mask, length).between(whole, whole))
        if variant == "a2a":
            return ulysses_attention(q, k, v, group=None, is_causal=mask is None,
                                     mask=sized(mask, length, layout, world))
        return ring_attention(q, k, v, group=None, is_causal=mask is None, comm=variant,
                              mask=sized(mask, length, layout, world))

    def inputs(tokens: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(rank)
        return [torch.randn(1, args.heads, tokens, args.head_dim, generator=generator) for _ in range(4)]

    def leaves(tokens: int) -> list[torch.Tensor]:
        q, k, v, dout = inputs(tokens)
        return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout]

    q, k, v, dout = leaves(2 * 64 * world)  # warm-up: kernels, threads and gloo pairs set up outside the figures
    attend(q, k, v).backward(dout)
    with LiveStorage() as memory:
        q, k, v, dout = leaves(args.seq // world)
        attend(q, k, v).backward(dout)
    q.grad = k.grad = v.grad = None
    wall, cpu = [], []
    for _ in range(args.iters):
        if world > 1:
            dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        attend(q, k, v).backward(dout)
        if world > 1:
            dist.barrier()  # wall time of the slowest rank
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        q.grad = k.grad = v.grad = None
    out.write_text(json.dumps({"peak_mib": memory.peak / 2**20, "wall_s": min(wall), "cpu_s": min(cpu)}))
    if world > 1:
        dist.destroy_process_group()


def sequence_mask(args: argparse.Namespace, seq: int):
    """The benchmark's mask over ``seq`` tokens (None: plain causal)."""
    if args.mask == "causal":
        return None
    if args.mask == "window":
        return SequenceMask(causal=True, window=args.window)
    generator = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seq:
        if args.documents == "equal":
            length = args.window
        else:
            length = int(torch.randint(max(args.window // 16, 1), 4 * args.window + 1, (1,), generator=generator))
        lengths.append(min(length, seq - total))
        total += lengths[-1]
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    return SequenceMask(causal=True, documents=documents)


def sized(mask, length: int, layout: str = "zigzag", cp: int = 1):
    """``mask`` for a sequence of ``length`` (the warm-up runs a shorter one): documents cut to it, over ``cp``
    ranks in ``layout``."""
    if mask is None or mask.documents is None:
        return mask
    documents = mask.documents[:, :length]
    return SequenceMask(causal=True, documents=documents,
                        layout=balanced_layout(documents, cp) if layout == "balanced" and cp > 1 else None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_variant(variant: str, world: int, argv: list[str], tmp: Path) -> list[dict]:
    """Start ``world`` fresh processes for one variant and collect each rank's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", variant, "--rank", str(rank),
                               "--world", str(world), "--out", str(tmp / f"{variant}{rank}.json")], env=env)
             for rank in range(world)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"{variant}: ranks exited with {codes}")
    return [json.loads((tmp / f"{variant}{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[4])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mask", choices=MASKS, default="causal")
    parser.add_argument("--window", type=int, default=1024, help="the sliding window; the packed documents' length")
    parser.add_argument("--documents", choices=("equal", "mixed"), default="mixed")
    parser.add_argument("--layout", nargs="+", choices=LAYOUTS, default=["zigzag"],
                        help="how packed documents are laid out over the cp ranks (--mask packed)")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--name", default="cp")
    args = parser.parse_args()
    if args.worker:
        args.seq = args.seq[0]
        worker(args.worker, args.rank, args.world, args, args.out)
        return
    for seq in args.seq:
        for cp in args.cp:
            if seq % (2 * cp):
                raise SystemExit(f"--seq {seq} must be a multiple of 2*cp = {2 * cp}")
    if args.layout != ["zigzag"] and args.mask != "packed":
        raise SystemExit(f"--layout {' '.join(args.layout)}: only packed documents (--mask packed) have another layout")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seq:
            argv = ["--seq", str(seq), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
                    "--iters", str(args.iters), "--mask", args.mask, "--window", str(args.window),
                    "--documents", args.documents]
            runs = [(variant, 1, "zigzag") if variant == "single" else (variant, cp, layout)
                    for variant in args.variants for cp in ([1] if variant == "single" else args.cp)
                    for layout in (["zigzag"] if variant == "single" else args.layout)]
            for variant, world, layout in runs:
                ranks = run_variant(variant, world, [*argv, "--layout", layout], Path(tmp))
                row = {"seq": seq, "mask": _mask_name(args), "variant": variant, "processes": world,
                       "peak_mib_per_rank": max(r["peak_mib"] for r in ranks),
                       "wall_s": max(r["wall_s"] for r in ranks),
                       "cpu_s_per_rank": max(r["cpu_s"] for r in ranks),
                       "cpu_s_fastest_rank": min(r["cpu_s"] for r in ranks),
                       "cpu_s_by_rank": [r["cpu_s"] for r in ranks]}
                if args.mask == "packed" and variant in ("ring", "allgather"):
                    mask = sized(sequence_mask(args, seq), seq, layout, world)
                    work = [WHOLE_COST * whole + MASKED_COST * masked
                            for whole, masked in (tile_work(mask, seq, world, rank) for rank in range(world))]
                    row.update(layout=layout, work_busiest_m=max(work) / WHOLE_COST / 1e6,
                               work_busiest_vs_idlest=max(work) / min(work), work_by_rank=work)
                rows.append(row)
    for row in rows:
        single = [r for r in rows if r["seq"] == row["seq"] and r["variant"] == "single"]
        if single:
            row["memory_vs_single"] = row["peak_mib_per_rank"] / single[0]["peak_mib_per_rank"]
    payload = {"command": command("cp.py"), "heads": args.heads, "head_dim": args.head_dim, "iters": args.iters,
               "mask": _mask_name(args), "results": rows}
    print(table("cp", payload), f"\n(written to {write(args.name, payload)})")


def _mask_name(args: argparse.Namespace) -> str:
    if args.mask == "window":
        return f"window {args.window}"
    if args.mask == "packed":
        return f"packed {args.documents} (~{args.window})"
    return "causal"


if __name__ == "__main__":
    main()
