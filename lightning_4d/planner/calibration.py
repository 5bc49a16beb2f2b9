"""Calibrating the step-time model (:mod:`.step_time`) on the machine it runs on, in seconds, cached.

What is measured is what the model divides by: one rank's matmul throughput per dtype, the throughput a whole
transformer block reaches forward and backward at several widths (what the matmuls leave to norms, softmax and
small kernels shows there), and its memory bandwidth (rank 0's device alone, with its own thread settings: a CPU
rank under ``OMP_NUM_THREADS=1`` measures one core),
and, on the process groups themselves, the latency and bandwidth of an all-reduce for groups of 2 ranks and of
the whole node (and of two ranks on different nodes when there are several). Measured with every rank of the
machine running at once, as in training: where CPU ranks share cores, the figures include the sharing.

The result is cached per machine, software and rank count (``~/.cache/lightning_4d/calibration``, or
``$LIGHTNING_4D_CACHE``): a later run on the same machine reads it instead of measuring.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from lightning_4d.planner.step_time import Link, Machine

DTYPES = ("float32", "bfloat16")
VERSION = 2  # of what is measured: a cache of another version is measured again
CACHE_ENV = "LIGHTNING_4D_CACHE"
PRESETS = {
    # Spec-sheet figures (dense bf16 at the ~40% of peak large matmuls reach in training, HBM3, NVLink 4 bus
    # bandwidth, 400 Gb/s InfiniBand per GPU), for planning without the machine: not measured.
    "h100": Machine(matmul_flops={"bfloat16": 400e12, "float16": 400e12, "float32": 50e12},
                    memory_bandwidth=2.0e12, links={2: Link(10e-6, 150e9), 8: Link(25e-6, 150e9)},
                    devices_per_node=8, cross_node=Link(30e-6, 40e9), overlap=True,
                    source="preset h100 (spec sheet, not measured)"),
}


def _seconds(action, repeats: int) -> float:
    """The median of ``repeats`` timings after one warm-up."""
    import torch

    action()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def measure_device(device: Any, size: Optional[int] = None, repeats: int = 5) -> dict[str, Any]:
    """One rank's matmul FLOP/s per dtype and memory bandwidth (bytes/s read and written by a copy)."""
    import torch

    device = torch.device(device)
    size = size or (4096 if device.type == "cuda" else 512)
    flops = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        flops[name] = 2 * size**3 / _seconds(lambda: torch.mm(a, b), repeats)
    source = torch.empty(32 * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() * 4 / _seconds(lambda: target.copy_(source), repeats)
    return {"matmul_flops": flops, "memory_bandwidth": bandwidth, "block_flops": measure_blocks(device)}


def _block(width: int, device: Any, dtype: Any) -> Any:
    """A pre-norm transformer block (causal attention, 4x GELU MLP) of ``width``, from torch's own modules."""
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = nn.ModuleList([nn.LayerNorm(width), nn.LayerNorm(width)])
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.heads = max(1, width // 64)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norms[0](x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + self.out(attention)
            return x + self.down(F.gelu(self.up(self.norms[1](x))))

    return Block().to(device=device, dtype=dtype)


def measure_blocks(device: Any, repeats: int = 3) -> dict[str, dict[int, float]]:
    """FLOP/s a whole transformer block reaches, forward and backward, by width (its matmul FLOPs over the time
    of everything it runs: norms, softmax, activations, autograd), per dtype; fp32 only on CPU."""
    import torch

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    widths, tokens, seq = ((512, 1024, 2048, 4096), 8192, 1024) if on_gpu else ((64, 128, 256, 512), 512, 128)
    curves: dict[str, dict[int, float]] = {}
    for name in (DTYPES if on_gpu else ("float32",)):
        dtype = getattr(torch, name)
        curve = {}
        for width in widths:
            block = _block(width, device, dtype)
            x = torch.randn(tokens // seq, seq, width, device=device, dtype=dtype, requires_grad=True)
            matmuls = 3 * tokens * (2 * 12 * width * width + 2 * width * seq)  # forward and backward, causal
            curve[width] = matmuls / _seconds(lambda: block(x).float().sum().backward(), repeats)
        curves[name] = curve
    return curves


def _fit(small: tuple[float, float], large: tuple[float, float]) -> Link:
    """``latency + bytes / bandwidth`` through two (bytes sent, seconds) points."""
    (b1, t1), (b2, t2) = small, large
    bandwidth = (b2 - b1) / max(t2 - t1, 1e-9)
    return Link(max(t1 - b1 / bandwidth, 1e-7), bandwidth)


def measure_links(device: Any, ranks_per_node: int, repeats: int = 5) -> tuple[dict[int, Link], Optional[Link]]:
    """Collective: every rank of the initialized default group calls it. All-reduces over the first 2 ranks and
    over the first node's ranks, and over rank 0 and the second node's first rank when there are several nodes."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    large = 64 * 2**20 if torch.device(device).type == "cuda" else 4 * 2**20
    groups = {size: list(range(size)) for size in sorted({2, min(ranks_per_node, world)}) if 2 <= size <= world}
    if world > ranks_per_node:
        groups[-2] = [0, ranks_per_node]
    links: dict[int, Link] = {}
    for size, members in groups.items():
        group = dist.new_group(members)  # every rank makes every group
        if rank in members:
            points = []
            for nbytes in (4096, large):
                tensor = torch.ones(nbytes // 4, device=device)
                seconds = _seconds(lambda: dist.all_reduce(tensor, group=group), repeats)
                points.append((2 * (len(members) - 1) / len(members) * nbytes, seconds))
            links[size] = _fit(*points)
        dist.barrier()
    shared = [None] * world
    dist.all_gather_object(shared, {size: (link.latency_s, link.bandwidth) for size, link in links.items()})
    measured = {size: Link(*values) for size, values in shared[0].items()}  # rank 0 is in every group
    cross = measured.pop(-2, None)
    return measured, cross


def cache_key(device_name: str, backend: str, ranks_per_node: int, nodes: int) -> str:
    """What makes two calibrations comparable: the host, its device, the backend, the rank counts, torch's version
    and threads."""
    import torch

    parts = [str(VERSION), platform.node(), platform.machine(), device_name, backend, str(ranks_per_node), str(nodes),
             torch.__version__, str(torch.get_num_threads()), str(os.cpu_count())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_path(key: str) -> Path:
    """Where the calibration of ``key`` is kept."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_4d")
    return root / "calibration" / f"{key}.json"


def load_cached(key: str) -> Optional[Machine]:
    """The cached machine of ``key``, or None (none yet, or unreadable)."""
    path = cache_path(key)
    try:
        return Machine.from_dict(json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError, KeyError):
        return None


def save_cached(key: str, machine: Machine) -> Path:
    """``machine`` kept under ``key`` (written whole, then renamed into place)."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(machine.as_dict(), indent=1))
    partial.replace(path)
    return path


def cores_for_ranks() -> Optional[int]:
    """The cores CPU ranks of this machine share (None on GPUs: a device each)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def calibrate(device: Any, ranks_per_node: int, use_cache: bool = True) -> Machine:
    """Collective over the default group: the machine as measured here (or read from the cache). Every rank
    returns the same figures (rank 0's device and the links it took part in)."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    world = dist.get_world_size()
    nodes = max(1, world // ranks_per_node)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    key = cache_key(name, dist.get_backend(), ranks_per_node, nodes)
    cached = [load_cached(key) if use_cache and dist.get_rank() == 0 else None]
    dist.broadcast_object_list(cached, src=0)
    if cached[0] is not None:
        return cached[0]
    # rank 0's device alone, the others waiting: where CPU ranks share cores, the model spreads their work itself
    figures = [measure_device(device) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(figures, src=0)
    figures = figures[0]
    links, cross = measure_links(device, ranks_per_node)
    on_cpu = device.type == "cpu"
    machine = Machine(matmul_flops=figures["matmul_flops"], memory_bandwidth=figures["memory_bandwidth"],
                      block_flops=figures["block_flops"], links=links, devices_per_node=ranks_per_node, cross_node=cross,
                      cores_per_node=cores_for_ranks() if on_cpu else None, overlap=not on_cpu,
                      source=f"measured on {platform.node()} ({name}, {world} ranks, {dist.get_backend()})")
    if dist.get_rank() == 0:
        save_cached(key, machine)
    return machine


def _measure_rank(rank: int, world: int, port: int, backend: str, result: str) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent's (measure_here)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        machine = calibrate(device, world, use_cache=False)
        if rank == 0:
            Path(result).write_text(json.dumps(machine.as_dict()))
    finally:
        dist.destroy_process_group()


def measure_here(devices: int, use_cache: bool = True) -> Machine:
    """The machine as ``devices`` ranks on this host see it (``python -m lightning_4d.plan --measure``): GPUs with
    NCCL where there are enough, else CPU processes with gloo; from the cache when it holds this host's figures."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= devices
    backend = "nccl" if on_gpu else "gloo"
    name = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu"
    key = cache_key(name, backend, devices, 1)
    if use_cache and (cached := load_cached(key)) is not None:
        return cached
    import torch.distributed as dist

    # The store listens before the ranks start, on a port it bound itself: a port found free and handed to the
    # ranks could be taken by another connection before rank 0 listened on it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "machine.json")
        mp.start_processes(_measure_rank, args=(devices, store.port, backend, result), nprocs=devices,
                           start_method="spawn")
        return Machine.from_dict(json.loads(Path(result).read_text()))  # cached by calibrate
