"""Calibrating the step-time model (:mod:`.step_time`) on the machine it runs on, in seconds, cached.

What is measured is what the model divides by: one rank's matmul throughput per dtype and its memory bandwidth
(rank 0's device alone, with its own thread settings: a CPU rank under ``OMP_NUM_THREADS=1`` measures one core),
the throughput a whole transformer block reaches forward and backward at several widths (what the matmuls leave
to norms, softmax and small kernels shows there) and the seconds per parameter of an optimizer step (on CPU with
every rank running at once: ranks that share caches and memory compute slower together),
and, on the process groups themselves, the latency and bandwidth of an all-reduce for groups of 2 ranks and of
the whole node (and of two ranks on different nodes when there are several), and of FSDP's all-gather and
reduce-scatter on the same groups. Measured with every rank of the
machine running at once, as in training: where CPU ranks share cores, the figures include the sharing. Last, on
the same groups, what tensor parallelism, ring attention and FSDP cost a small block beyond its FLOPs and
collectives (:func:`measure_overheads`), how much slower CPU ranks compute while all of them do, and the
memory a rank's runtime takes while they run.

The result is cached per machine, software and rank count (``~/.cache/lightning_4d/calibration``, or
``$LIGHTNING_4D_CACHE``): a later run on the same machine reads it instead of measuring.
"""

from __future__ import annotations

import dataclasses
import functools
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
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what the model times at a link of its own
VERSION = 7  # of what is measured: a cache of another version is measured again
CACHE_ENV = "LIGHTNING_4D_CACHE"
PRESETS = {
    # Spec-sheet figures (dense bf16 at the ~40% of peak large matmuls reach in training, HBM3, NVLink 4 bus
    # bandwidth, 400 Gb/s InfiniBand per GPU), for planning without the machine: not measured.
    "h100": Machine(matmul_flops={"bfloat16": 400e12, "float16": 400e12, "float32": 50e12},
                    memory_bandwidth=2.0e12, links={2: Link(10e-6, 150e9), 8: Link(25e-6, 150e9)},
                    devices_per_node=8, cross_node=Link(30e-6, 40e9), overlap=True,
                    source="preset h100 (spec sheet, not measured)"),
}


def _seconds(action, repeats: int, warmups: int = 1, cpu: bool = False) -> Any:
    """The median of ``repeats`` timings after ``warmups`` untimed calls (with ``cpu``: and of the process's CPU
    time over the same calls)."""
    import torch

    for _ in range(warmups):
        action()
    timings, cpu_times = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        action()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - started_cpu)
    return (statistics.median(timings), statistics.median(cpu_times)) if cpu else statistics.median(timings)


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
    return {"matmul_flops": flops, "memory_bandwidth": bandwidth}


def measure_optimizers(device: Any, repeats: int = 5, cpu_time: bool = False) -> dict[str, float]:
    """Seconds per parameter of one step of AdamW and of SGD with momentum, torch's default implementation on
    the device, over a 256-wide block's parameters (what the step does per tensor shows there as on a model's
    blocks); with ``cpu_time``, the process's CPU time."""
    import torch

    parameters = list(_block(256, device, torch.float32).parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    count = sum(p.numel() for p in parameters)
    steps = {"adamw": torch.optim.AdamW(parameters, lr=1e-4), "sgd": torch.optim.SGD(parameters, lr=1e-4, momentum=0.9)}
    figures = {name: _seconds(optimizer.step, repeats, cpu=cpu_time) for name, optimizer in steps.items()}
    return {name: (seconds[1] if cpu_time else seconds) / count for name, seconds in figures.items()}


def _block(width: int, device: Any, dtype: Any, head_dim: int = 64) -> Any:
    """A pre-norm transformer block (causal attention, 4x GELU MLP) of ``width``, from torch's own modules; the
    heads are whatever ``head_dim`` leaves of the projections' width, so a tensor-parallel shard runs its own."""
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = nn.ModuleList([nn.LayerNorm(width), nn.LayerNorm(width)])
            self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.attention = functools.partial(F.scaled_dot_product_attention, is_causal=True)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.norms[0](x)
            q, k, v = (f(h).view(b, t, -1, min(head_dim, width)).transpose(1, 2) for f in (self.q, self.k, self.v))
            x = x + self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, t, -1))
            return x + self.down(F.gelu(self.up(self.norms[1](x))))

    return Block().to(device=device, dtype=dtype)


def measure_blocks(device: Any, repeats: int = 3, cpu_time: bool = False) -> tuple[dict[str, dict[int, float]],
                                                                                   dict[str, float]]:
    """A whole transformer block's forward and backward, per dtype (fp32 only on CPU): its fixed cost, the
    seconds it takes whatever its size (kernel launches, dispatch, autograd's bookkeeping: a 16-wide block on
    16 tokens, which computes next to nothing), which small micro-batches pay as often as large ones; and by
    width, the FLOP/s it reaches beyond that (its matmul FLOPs over the rest of its time: norms, softmax,
    activations). With ``cpu_time``, in the process's CPU time."""
    import torch

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    widths, tokens, seq = ((512, 1024, 2048, 4096), 8192, 1024) if on_gpu else ((64, 128, 256, 512), 512, 128)

    def timed(width: int, dtype: Any, shape: tuple[int, int], times: int) -> float:
        block = _block(width, device, dtype)
        x = torch.randn(*shape, width, device=device, dtype=dtype, requires_grad=True)
        seconds = _seconds(lambda: block(x).float().sum().backward(), times, cpu=cpu_time)
        return seconds[1] if cpu_time else seconds

    curves: dict[str, dict[int, float]] = {}
    fixed: dict[str, float] = {}
    for name in (DTYPES if on_gpu else ("float32",)):
        dtype = getattr(torch, name)
        fixed[name] = timed(16, dtype, (1, 16), 3 * repeats)
        matmuls = {width: 3 * tokens * (2 * 12 * width * width + 2 * width * seq) for width in widths}  # causal
        curves[name] = {width: matmuls[width] / max(timed(width, dtype, (tokens // seq, seq), repeats) - fixed[name],
                                                    1e-9) for width in widths}
    return curves, fixed


OVERHEAD_SHAPE = (4, 128, 128)  # sequences, tokens, width of the block the dimensions' costs are measured on
OVERHEAD_HEAD_DIM = 16  # 8 heads: a tensor-parallel group of up to 8 ranks holds whole heads


def _largest(figure: float) -> float:
    """Collective: the largest of every rank's ``figure`` (the slowest rank's seconds, the fullest's bytes)."""
    import torch.distributed as dist

    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, figure)
    return max(figures)


def _memory_mark(device: Any) -> Any:
    """Where :func:`_memory_grown` counts from: on CUDA the device's free memory (NCCL's buffers are not in
    torch's statistics, and what the caching allocator keeps is not the tensors'), elsewhere the resident set
    with its high-water mark restarted (:class:`~lightning_4d.observability.telemetry.PeakMemory`). What the
    allocators kept of the probe's earlier tensors is handed back first: it would serve the growth measured."""
    import torch

    from lightning_4d.observability.telemetry import PeakMemory

    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    _trim_heap()
    mark = PeakMemory(device)
    mark.start()
    return mark


def _trim_heap() -> None:
    """glibc's free memory handed back to the system, where there is glibc: what it kept of the probe's earlier
    large tensors would otherwise serve the growth measured next, which then reads short (10 MiB at 4 processes
    here; 40 after the trim, and 22 with a fixed mmap threshold, under which freed tensors are returned at
    once)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # no C library by that name, or not glibc
        return


def _memory_grown(device: Any, mark: Any) -> float:
    """Bytes this process took since ``mark``: on CUDA the free memory it no longer has, elsewhere the peak of
    the resident set above it."""
    import torch

    grown = mark - torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else mark.growth()
    return max(0.0, float(grown))


def _modelled(machine: Machine, axis: str, size: int, alone: float, params: int) -> float:
    """What the step-time model already charges one rank of ``axis`` over ``size`` ranks for the probe's block,
    forward and backward: its share of the plain block's time beyond the block's fixed cost, which every share
    pays whole (tp at the narrower width's rate), and the
    collectives :func:`.step_time._communication` counts per block (tp: four all-reduces of the activations; cp:
    ``3 (size - 1)`` ring exchanges of its K/V; FSDP: two gathers and a reduce-scatter of the block); pp: per
    micro-batch, its pass through the stage and the boundary's sends."""
    batch, seq, width = OVERHEAD_SHAPE
    fixed = machine.block_fixed("32-true")
    if axis == "tp":
        rate = machine.flops("32-true", width) / machine.flops("32-true", width / size)
        activation = batch * seq * width * 4
        return ((alone - fixed) * rate / size + fixed
                + machine.link(size).seconds(4 * 2 * (size - 1) / size * activation, 4))
    if axis == "cp":
        kv = 2 * batch * seq // size * width * 4
        return (alone - fixed) / size + fixed + machine.link(2).seconds(3 * (size - 1) * kv, 3 * (size - 1))
    if axis == "pp":  # per micro-batch of one sequence: its pass and its boundary sends
        sends = 2 * (2 if size > 2 else 1)
        return (alone - fixed) / batch + fixed + machine.link(2).seconds(sends * seq * width * 4, sends)
    return (alone + machine.link(size, op="all_gather").seconds((size - 1) / size * 2 * params * 4, 2)
            + machine.link(size, op="reduce_scatter").seconds((size - 1) / size * params * 4))


def measure_overheads(device: Any, machine: Machine, repeats: int = 9) -> Machine:
    """Collective: ``machine`` with what each dimension costs a block beyond the model's account of it
    (:func:`_modelled`), and on CPU how much slower a rank computes while every rank does.

    Every rank runs the probe's block at once, in groups of 2 ranks and of a node's ranks (a 2-D mesh over the
    world, as training runs): sharded by torch's tensor-parallel styles, with :func:`ring_attention` over a
    ``1 / size`` share of the tokens, and under FSDP2's ``fully_shard``. A figure is the slowest rank's time of a
    forward and backward (over ``concurrency`` on CPU, to count as one rank's work, as the model does) less what
    the model charges for it: below 0 where the model's collectives cost more than the block took. And a
    pipeline of one block per rank, ``torch.distributed.pipelining``'s 1F1B over ``2 size`` micro-batches of one
    sequence: per micro-batch, the slowest rank's time (on CPU its CPU time: a stage's wait for its neighbour is
    not work, and the model counts the bubble itself) less its pass and sends.

    Meanwhile the fullest rank's growth in memory is ``runtime_bytes``: what running the dimensions takes beside a
    model's tensors (new process groups' buffers and threads, autograd's, DTensor's, FSDP's and the pipeline's
    state), with the probe's own small tensors (a few MB) in it; the planner adds it to every layout's memory.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_4d.context_parallel.ring_attention import ring_attention

    device, world = torch.device(device), dist.get_world_size()
    mark = _memory_mark(device)
    batch, seq, width = OVERHEAD_SHAPE
    tokens = torch.randn(batch, seq, width, device=device)

    def step(block: Any, share: int = 1) -> Any:
        x = tokens[:, : seq // share].detach().requires_grad_()
        return lambda: block(x).float().sum().backward()

    plain = _block(width, device, torch.float32, OVERHEAD_HEAD_DIM)
    dist.barrier()
    wall, cpu = _seconds(step(plain), repeats, warmups=2, cpu=True)
    # A CPU rank's own work is its CPU time; its wall time with every rank running is longer by the sharing.
    alone = _largest(cpu if device.type == "cpu" else wall)
    concurrency = max(1.0, _largest(wall) / alone) if device.type == "cpu" else 1.0
    params = sum(p.numel() for p in plain.parameters())
    overheads: dict[str, dict[int, float]] = {"tp": {}, "cp": {}, "dp_shard": {}, "pp": {}}

    def pipeline(mesh: Any, size: int) -> Any:
        """One 1F1B step of a pipeline of one block per rank over ``mesh``."""
        index, microbatches = mesh.get_local_rank(), 2 * size
        x = torch.randn(microbatches, seq, width, device=device)
        stage = PipelineStage(_block(width, device, torch.float32, OVERHEAD_HEAD_DIM), index, size, device,
                              group=mesh.get_group(), input_args=(x[:1],))
        schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lambda out, _: out.float().sum())
        ends = {0: lambda: schedule.step(x), size - 1: lambda: schedule.step(target=x, losses=[])}
        return ends.get(index, schedule.step)

    for size in sorted({2, min(machine.devices_per_node, world)}):
        if size < 2 or world % size:
            continue
        mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("others", "group"))["group"]
        tp = _block(width, device, torch.float32, OVERHEAD_HEAD_DIM)
        styles = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "up": ColwiseParallel(),
                  "out": RowwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(tp, mesh, styles)
        ring = _block(width, device, torch.float32, OVERHEAD_HEAD_DIM)
        ring.attention = functools.partial(ring_attention, group=mesh.get_group(), is_causal=True)
        sharded = fully_shard(_block(width, device, torch.float32, OVERHEAD_HEAD_DIM), mesh=mesh)
        for axis, action in (("tp", step(tp)), ("cp", step(ring, size)), ("dp_shard", step(sharded))):
            dist.barrier()
            seconds = _largest(_seconds(action, repeats, warmups=2)) / concurrency
            overheads[axis][size] = seconds - _modelled(machine, axis, size, alone, params)
        dist.barrier()
        wall, cpu = _seconds(pipeline(mesh, size), repeats, warmups=2, cpu=True)
        seconds = _largest(cpu if device.type == "cpu" else wall * (1 - (size - 1) / (3 * size - 1))) / (2 * size)
        overheads["pp"][size] = seconds - _modelled(machine, "pp", size, alone, params)
    return dataclasses.replace(machine, overheads=overheads, runtime_bytes=_largest(_memory_grown(device, mark)),
                               concurrency=concurrency if machine.cores_per_node else None)


def _fit(small: tuple[float, float], large: tuple[float, float]) -> Link:
    """``latency + bytes / bandwidth`` through two (bytes sent, seconds) points."""
    (b1, t1), (b2, t2) = small, large
    bandwidth = (b2 - b1) / max(t2 - t1, 1e-9)
    return Link(max(t1 - b1 / bandwidth, 1e-7), bandwidth)


def _collective(op: str, full: Any, share: Any, group: Any) -> None:
    """One ``op`` over ``group``: an all-reduce of ``full``, or ``share`` gathered into it, or it scattered into
    ``share``."""
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(full, share, group=group)
    else:
        dist.reduce_scatter_tensor(share, full, group=group)


def measure_links(device: Any, ranks_per_node: int, repeats: int = 5) -> tuple[dict[str, dict[int, Link]],
                                                                                 Optional[Link]]:
    """Collective: every rank of the initialized default group calls it. By op (``all_reduce``, and FSDP's
    ``all_gather`` and ``reduce_scatter``), over the first 2 ranks and over the first node's ranks; and an
    all-reduce over rank 0 and the second node's first rank when there are several nodes. A point's bytes are
    what one rank sends of a tensor of the full size (the gathered output, the scattered input), as the model
    counts them."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    large = 64 * 2**20 if torch.device(device).type == "cuda" else 16 * 2**20  # a block of a 512-wide model: 12 MB
    groups = {size: list(range(size)) for size in sorted({2, min(ranks_per_node, world)}) if 2 <= size <= world}
    if world > ranks_per_node:
        groups[-2] = [0, ranks_per_node]
    links: dict[str, dict[int, Link]] = {op: {} for op in COLLECTIVES}
    for size, members in groups.items():
        group = dist.new_group(members)  # every rank makes every group
        if rank in members:
            n = len(members)
            for op in COLLECTIVES if size > 0 else ("all_reduce",):  # across nodes: the all-reduce only
                points = []
                for target in (4096, large):
                    share = torch.ones(target // 4 // n, device=device)
                    full = torch.ones(share.numel() * n, device=device)
                    sent = (2 if op == "all_reduce" else 1) * (n - 1) / n * full.numel() * 4
                    points.append((sent, _seconds(functools.partial(_collective, op, full, share, group), repeats)))
                links[op][size] = _fit(*points)
        dist.barrier()
    shared = [None] * world
    dist.all_gather_object(shared, {op: {size: (link.latency_s, link.bandwidth) for size, link in by_size.items()}
                                    for op, by_size in links.items()})
    measured = {op: {size: Link(*values) for size, values in by_size.items()}  # rank 0 is in every group
                for op, by_size in shared[0].items()}
    cross = measured["all_reduce"].pop(-2, None)
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


def _measure(device: Any, ranks_per_node: int, name: str) -> Machine:
    """Collective: :func:`calibrate`'s measurements, uncached."""
    import torch.distributed as dist

    world, on_cpu = dist.get_world_size(), device.type == "cpu"
    # The matmul and copy rates: rank 0's device alone, the others waiting. A block's rate and an optimizer step
    # on a GPU too; on CPU every rank measures them at once in CPU time, the slowest rank's: ranks that share a
    # machine's caches and memory compute slower together (the sharing of cores the model adds itself).
    figures = [measure_device(device) if dist.get_rank() == 0 else None]
    if not on_cpu and dist.get_rank() == 0:
        curves, fixed = measure_blocks(device)
        figures[0].update(block_flops=curves, block_fixed_s=fixed, optimizer_seconds=measure_optimizers(device))
    dist.broadcast_object_list(figures, src=0)
    figures = figures[0]
    if on_cpu:
        everyone: list[Any] = [None] * world
        mine = (measure_blocks(device, cpu_time=True), measure_optimizers(device, cpu_time=True))
        dist.all_gather_object(everyone, mine)
        blocks, steps = zip(*everyone)  # each rank's (rates, fixed costs): the slowest rank's
        figures["block_flops"] = {"float32": {w: min(b[0]["float32"][w] for b in blocks)
                                              for w in blocks[0][0]["float32"]}}
        figures["block_fixed_s"] = {"float32": max(b[1]["float32"] for b in blocks)}
        figures["optimizer_seconds"] = {step: max(s[step] for s in steps) for step in steps[0]}
    links, cross = measure_links(device, ranks_per_node)
    links, op_links = links.pop("all_reduce"), links
    machine = Machine(matmul_flops=figures["matmul_flops"], memory_bandwidth=figures["memory_bandwidth"],
                      block_flops=figures["block_flops"], block_fixed_s=figures["block_fixed_s"],
                      optimizer_seconds=figures["optimizer_seconds"], links=links, op_links=op_links,
                      devices_per_node=ranks_per_node, cross_node=cross,
                      cores_per_node=cores_for_ranks() if on_cpu else None, overlap=not on_cpu,
                      source=f"measured on {platform.node()} ({name}, {world} ranks, {dist.get_backend()})")
    return measure_overheads(device, machine)


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
    # The probe's tensors and modules draw from torch's generators: the user's run goes on as if it never ran.
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        machine = _measure(device, ranks_per_node, name)
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
