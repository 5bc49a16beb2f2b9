"""A layout's predicted step time: compute at a measured throughput, communication per axis at a measured latency
and bandwidth with the overlap each dimension has, and the pipeline's bubble.

Bytes sent are not time: axes differ in bandwidth, some traffic hides behind compute, a pipeline idles, and
activation checkpointing computes again. Per device, on the pipeline rank with most layers:

* **compute**: matmul FLOPs at the throughput a whole transformer block reaches at the layout's width
  (``hidden / tp``) for the precision's dtype, as the probe measured it (the bare matmul's where it did not). Per token and block,
  forward: ``2 * matrix parameters / tp`` for the projections and ``2 * hidden * seq / tp`` for causal attention
  (scores and values over the whole sequence, half of it masked; cp splits the queries, not the keys), and
  ``2 * vocab * hidden / tp`` for the head on the last stage. Backward is twice the forward. Activation
  checkpointing computes the checkpointed blocks' forward again (``"selective"``: their attention only). Each
  block of each micro-batch also pays the block's fixed cost (``block_fixed_s``: what its forward and backward
  take whatever its size, measured), which small micro-batches pay as often as large ones.
* **memory-bound work**: the elementwise kernels (each kept activation written in forward, read and its gradient
  written in backward: three passes) at the measured memory bandwidth, and the optimizer step over the rank's
  share of the parameters at the measured seconds per parameter (where not measured: AdamW reads parameter,
  gradient and two moments and writes three, seven passes at the memory bandwidth).
* **communication**: each collective costs ``latency + bytes sent / bandwidth`` for its group's size, from the
  probe's fit (:mod:`.calibration`): tp's four all-reduces per block and micro-batch (and two more per
  recomputed block); cp's ring, ``3 (cp - 1)`` key/value exchanges per block; the data-parallel gradient
  all-reduce in buckets of ``bucket_mb``; FSDP's gathers and reduce-scatters per block (at their own measured
  links: gloo moves their bytes 2-3x slower than an all-reduce's); the pipeline's two
  boundary transfers per micro-batch; and the step's own small collectives outside the blocks (the strategy's
  step agreement, the token-mean loss's count, the pipeline's results, Lightning's ``sync_dist`` logging: see
  :func:`_step_collectives`), each at its group's latency. Where the machine overlaps communication with
  compute (GPUs: copy engines; not gloo on CPU, whose transfers are the same cores' work), the buckets hide
  behind the backward, FSDP's prefetched gathers behind the blocks, and the ring's exchanges behind attention;
  what exceeds the compute is exposed. tp's all-reduces sit between dependent matmuls and are never hidden.
* **what a dimension costs beyond that** (``overheads``): torch's tensor-parallel styles dispatch every op of a
  block through DTensor, ring attention runs its tiles and their merges as many small kernels, FSDP runs hooks
  around each unit; on small blocks these per-operation costs outweigh the FLOPs. The probe measures them per
  block forward and backward on the machine's own groups (:func:`.calibration.measure_overheads`), and each
  block (FSDP: each unit) of each micro-batch pays them; a pipeline's schedule costs each micro-batch on each of
  a rank's stages. A figure below 0 corrects the collectives above where the
  all-reduce's latency over-charges a dimension's own (never below none).
* **bubble**: a pipeline step is the stage's work over ``1 - bubble``, with ``bubble = (pp - 1) / (v m + pp - 1)``
  (``v``: stages per rank for the interleaved schedules; the zero-bubble schedules split the backward in two
  and fill a third of it: ``3 m``).
* **shared cores** (CPU ranks that outnumber the cores of their machine): a rank that waits gives its core to
  another, so the step is the longer of the critical path above and all ranks' work spread over the cores: a
  rank's work times how much slower a block runs with every rank at once than alone (``concurrency``, measured;
  ranks over cores where it was not), the step's small collectives as measured (waits, not work), and a
  pipeline's bubble at the alone rate: its warm-up and cool-down pass the first and last micro-batches from stage
  to stage, one after another, with cores idle (measured at 4 processes on 2 cores: the pipelined layouts
  -8 to +6% with it, -12 to -31% without).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_4d.planner.estimate import (PRECISIONS, Layout, Training, _checkpointed, _microbatches, _stage_layers,
                                           _stage_params, _tokens, activation_bytes_per_layer, choose_cp_comm,
                                           cp_exchanges)
from lightning_4d.planner.model_sizes import Model, PlanError

DTYPES = {"32-true": "float32", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "16-mixed": "float16",
          "16-true": "float16"}
OPTIMIZER_PASSES = {"adamw": 7, "adam": 7, "sgd": 5, "none": 0}  # reads and writes per parameter per step
BUCKET_MB = 25.0  # lightning_4d.data_parallel.DEFAULT_BUCKET_MB (tests/test_step_time.py keeps them equal)
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class Link:
    """One collective over a group: ``latency_s + bytes one rank sends / bandwidth``."""

    latency_s: float
    bandwidth: float  # bytes per second one rank sends

    def seconds(self, sent_bytes: float, count: float = 1.0) -> float:
        return count * self.latency_s + sent_bytes / self.bandwidth


def _along_log2(curve: dict[int, float], x: float, geometric: bool = False) -> float:
    """``curve`` at ``x``: linear in log2 of ``x`` between the points measured (in the log of the value where
    ``geometric``), the nearest end beyond them."""
    points = sorted(curve)
    if x <= points[0] or x >= points[-1]:
        return curve[points[0] if x <= points[0] else points[-1]]
    upper = next(p for p in points if p >= x)
    lower = points[points.index(upper) - 1]
    weight = (math.log2(x) - math.log2(lower)) / (math.log2(upper) - math.log2(lower))
    if geometric:
        return math.exp((1 - weight) * math.log(curve[lower]) + weight * math.log(curve[upper]))
    return (1 - weight) * curve[lower] + weight * curve[upper]


@dataclass(frozen=True)
class Machine:
    """What the step-time model needs of the hardware, measured by :mod:`.calibration` or given."""

    matmul_flops: dict[str, float]  # FLOP/s of one rank's device by dtype name (float32, bfloat16, float16)
    memory_bandwidth: float  # bytes/s of one rank's elementwise work
    links: dict[int, Link]  # all-reduces within a node, by group size; sizes not measured are interpolated
    devices_per_node: int
    cross_node: Optional[Link] = None  # a group that spans nodes
    cores_per_node: Optional[int] = None  # CPU ranks: the cores they share (None: a device each)
    overlap: bool = False  # communication runs beside compute
    source: str = "given"
    block_flops: dict[str, dict[int, float]] = field(default_factory=dict)  # a whole block's, by dtype and width
    # seconds a block's forward and backward cost beyond its compute and collectives, by axis and group size
    overheads: dict[str, dict[int, float]] = field(default_factory=dict)
    concurrency: Optional[float] = None  # CPU ranks sharing cores: a block's time all at once over alone
    block_fixed_s: dict[str, float] = field(default_factory=dict)  # a block's seconds whatever its size, by dtype
    optimizer_seconds: dict[str, float] = field(default_factory=dict)  # a step's seconds per parameter, by name
    # FSDP's collectives by op ("all_gather", "reduce_scatter") and group size, as ``links`` (the all-reduce's
    # where not measured): gloo moves a byte of them slower than of an all-reduce
    op_links: dict[str, dict[int, Link]] = field(default_factory=dict)
    # bytes a rank's runtime holds beside the model's tensors while the dimensions run (the process groups'
    # buffers and threads, autograd's, DTensor's and the pipeline's state): part of every layout's memory
    runtime_bytes: float = 0.0

    def flops(self, precision: str, width: Optional[float] = None) -> float:
        """FLOP/s of the precision's dtype: a whole block's at ``width`` where measured (interpolated in log
        width, geometrically in rate), else the bare matmul's."""
        dtype = DTYPES[precision]
        curve = self.block_flops.get(dtype) or (self.block_flops.get("float32") if dtype == "float32" else None)
        if curve and width:
            return _along_log2(curve, width, geometric=True)
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        return self.matmul_flops.get("bfloat16", self.matmul_flops["float32"])

    def block_fixed(self, precision: str) -> float:
        """Seconds a block's forward and backward cost whatever its size (fp32's for a dtype not measured; 0 where
        nothing was measured)."""
        return self.block_fixed_s.get(DTYPES[precision], self.block_fixed_s.get("float32", 0.0))

    def overhead(self, axis: str, size: int) -> float:
        """What ``axis`` costs a block beyond the model's account of it at a group of ``size`` (interpolated in
        log2 of the size; 0 where nothing was measured)."""
        curve = self.overheads.get(axis)
        return _along_log2(curve, size) if curve and size > 1 else 0.0

    def link(self, size: int, spans_nodes: bool = False, op: str = "all_reduce") -> Link:
        """The link of a group of ``size`` ranks for ``op`` (the all-reduce's where ``op`` was not measured):
        measured, or interpolated in latency (by log2 of the size) and bandwidth (the nearest measured size)
        between the sizes measured."""
        if spans_nodes and self.cross_node is not None:
            return self.cross_node
        links = self.op_links.get(op) or self.links
        if not links:
            raise PlanError(f"no collective was measured on this machine ({self.source}), so a group of {size} ranks"
                            " cannot be timed: calibrate with at least 2 processes.")
        if size in links:
            return links[size]
        sizes = sorted(links)
        below = max((s for s in sizes if s < size), default=sizes[0])
        above = min((s for s in sizes if s > size), default=sizes[-1])
        if below == above:
            scale = math.log2(max(size, 2)) / math.log2(max(below, 2))
            return Link(links[below].latency_s * scale, links[below].bandwidth)
        weight = (math.log2(size) - math.log2(below)) / (math.log2(above) - math.log2(below))
        latency = (1 - weight) * links[below].latency_s + weight * links[above].latency_s
        return Link(latency, min(links[below].bandwidth, links[above].bandwidth))

    def predict(self, model: Model, training: Training, layout: Layout) -> "StepTime":
        """:func:`step_time` of ``layout`` on this machine (how the planner, which step_time imports, calls it)."""
        return step_time(model, training, layout, self)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "links": {str(size): asdict(link) for size, link in self.links.items()},
                "op_links": {op: {str(size): asdict(link) for size, link in links.items()}
                             for op, links in self.op_links.items()},
                "block_flops": {dtype: {str(w): f for w, f in curve.items()} for dtype, curve in self.block_flops.items()},
                "overheads": {axis: {str(n): s for n, s in curve.items()} for axis, curve in self.overheads.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Machine":
        links = {int(size): Link(**link) for size, link in data["links"].items()}
        cross = Link(**data["cross_node"]) if data.get("cross_node") else None
        blocks = {dtype: {int(w): f for w, f in curve.items()} for dtype, curve in data.get("block_flops", {}).items()}
        overheads = {axis: {int(n): s for n, s in curve.items()} for axis, curve in data.get("overheads", {}).items()}
        ops = {op: {int(size): Link(**link) for size, link in by_size.items()}
               for op, by_size in data.get("op_links", {}).items()}
        return cls(**{**data, "links": links, "cross_node": cross, "block_flops": blocks, "overheads": overheads,
                      "op_links": ops})


@dataclass
class StepTime:
    """A layout's predicted step, in seconds by part; ``total`` is what the planner ranks by."""

    layout: Layout
    parts: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0  # the pipeline's idle fraction
    shared_cores: bool = False  # the total is the ranks' work spread over the cores

    @property
    def total(self) -> float:
        return self.parts["total"]

    def dominant(self) -> str:
        """The largest part, for the reason a choice is given."""
        return max((name for name in self.parts if name != "total"), key=self.parts.__getitem__)


def _spans_nodes(machine: Machine, size: int, inner: int) -> bool:
    """A group of ``size`` ranks ``inner`` apart in rank order spans nodes."""
    return size * inner > machine.devices_per_node and size > 1


def _strides(layout: Layout) -> dict[str, int]:
    """Rank distance between neighbours of each axis, in the strategy's mesh order ``(pp, dp_replicate, dp_shard,
    cp, tp)``, innermost last (:mod:`lightning_4d.parallel_dims`)."""
    cp = layout.tp * layout.cp
    return {"tp": 1, "cp": layout.tp, "dp_shard": cp, "dp": cp * layout.dp_shard,
            "pp": cp * layout.dp_shard * layout.dp}


def _stages_per_rank(training: Training, layout: Layout) -> int:
    from lightning_4d.pipeline.config import PipelineConfig

    return PipelineConfig(layout.pp, training.pp_schedule).stages_per_rank if layout.pp > 1 else 1


def _bubble(training: Training, layout: Layout, microbatches: int) -> float:
    if layout.pp == 1:
        return 0.0
    virtual = _stages_per_rank(training, layout)
    filled = 3 * microbatches if training.pp_schedule in ZERO_BUBBLE else virtual * microbatches
    return (layout.pp - 1) / (filled + layout.pp - 1)


def step_time(model: Model, training: Training, layout: Layout, machine: Machine,
              bucket_mb: float = BUCKET_MB) -> StepTime:
    """The predicted step of ``layout`` on ``machine`` (see the module docstring)."""
    pbytes, gbytes, e = PRECISIONS[training.precision]
    m = _microbatches(training, layout)
    tokens = _tokens(training, layout) * m  # per device per step
    tp, flops = layout.tp, machine.flops(training.precision, model.hidden / layout.tp)
    per_rank = _stage_layers(model.layers, layout.pp, training.pp_schedule)
    layers = max(per_rank)

    projections = 2 * model.layer_matrix_params / tp
    attention = 2 * model.hidden * training.seq_len / tp
    head = 2 * model.vocab * model.hidden / tp
    # the longest pipeline rank: most blocks, or the last with the head
    forward = tokens * max(count * (projections + attention) + (head if rank == layout.pp - 1 else 0.0)
                           for rank, count in enumerate(per_rank))
    checkpointed = _checkpointed(training, layers)
    selective = training.activation_checkpointing == "selective"
    recomputed = checkpointed * tokens * (attention if selective else projections + attention)
    fixed = machine.block_fixed(training.precision) * m  # each block, each micro-batch
    parts = {"compute": 3 * forward / flops + layers * fixed,  # a recomputed forward: a third of the fixed cost
             "recompute": recomputed / flops + (0.0 if selective else checkpointed * fixed / 3)}

    params = _stage_params(model, layout, layout.pp - 1, per_rank[-1])
    shards = layout.dp_shard * layout.cp if layout.dp_shard > 1 else 1
    activations = activation_bytes_per_layer(model, training, layout) * layers * m
    optimizer = machine.optimizer_seconds.get("adamw" if training.optimizer == "adam" else training.optimizer)
    parts["memory_bound"] = 3 * activations / machine.memory_bandwidth + (
        optimizer * params / shards if optimizer is not None
        else OPTIMIZER_PASSES[training.optimizer] * params * pbytes / shards / machine.memory_bandwidth)
    comm = _communication(model, training, layout, machine, params, checkpointed, bucket_mb)
    step = _step_collectives(training, layout, machine)
    if step:
        comm["step"] = step
    for axis, size, units in (("tp", tp, layers * m), ("cp", layout.cp, layers * m),
                              ("dp_shard", shards if layout.dp_shard > 1 else 1, layers + 1),
                              ("pp", layout.pp, m * _stages_per_rank(training, layout))):
        if size > 1 and machine.overhead(axis, size):  # a correction below 0 takes back at most the axis's collectives
            parts[f"overhead_{axis}"] = max(machine.overhead(axis, size) * units, -comm.get(axis, 0.0))
    work = sum(parts.values())  # compute, recompute, memory-bound work and the dimensions' overheads
    exposed = _exposed(comm, machine, layout, work, 2 * forward / flops,
                       3 * tokens * layers * attention / flops, m, layers, params * gbytes / (bucket_mb * 2**20))
    bubble = _bubble(training, layout, m)
    # what each micro-batch waits for: its work and tp's and cp's collectives (a correction below 0 of FSDP's or
    # the pipeline's collectives, which are not in it, takes nothing from it)
    corrections = sum(min(0.0, parts.get(f"overhead_{axis}", 0.0)) for axis in ("dp_shard", "pp"))
    in_stage = work - corrections + exposed.get("tp", 0.0) + exposed.get("cp", 0.0)
    parts.update({f"comm_{axis}": value for axis, value in exposed.items()})
    parts["bubble"] = in_stage * bubble / (1 - bubble)
    result = StepTime(layout, parts, bubble)
    critical = sum(parts.values())
    if machine.cores_per_node and machine.devices_per_node > machine.cores_per_node:
        # every rank's work (compute and gloo's transfers, which are CPU work) spread over the shared cores; the
        # step's small collectives are waits, whose measured latency already has every rank running; the bubble,
        # the stages' warm-up and cool-down in turn, leaves cores idle
        slower = machine.concurrency or machine.devices_per_node / machine.cores_per_node
        spread = slower * (work + sum(comm.values()) - step) + step + parts["bubble"]
        if spread > critical:
            result.shared_cores, critical = True, spread
    result.parts["total"] = critical
    return result


def _communication(model: Model, training: Training, layout: Layout, machine: Machine, params: float,
                   checkpointed: int, bucket_mb: float) -> dict[str, float]:
    """Seconds per step of each axis's collectives, none hidden."""
    _, gbytes, e = PRECISIONS[training.precision]
    m = _microbatches(training, layout)
    layers = max(_stage_layers(model.layers, layout.pp, training.pp_schedule))
    tp, strides = layout.tp, _strides(layout)

    def link(axis: str, size: int, op: str = "all_reduce") -> Link:
        return machine.link(size, _spans_nodes(machine, size, strides[axis]), op)

    activation = _tokens(training, layout) * model.hidden * e  # one micro-batch's block output
    grad_bytes = params * gbytes
    comm: dict[str, float] = {}
    if tp > 1:  # four all-reduces per block, two more per recomputed block, one for the embedding
        recomputed = checkpointed if training.activation_checkpointing != "selective" else 0
        count = (4 * layers + 2 * recomputed + 1) * m
        comm["tp"] = link("tp", tp).seconds(count * 2 * (tp - 1) / tp * activation, count)
    if layout.cp > 1:
        exchange = cp_exchanges(model, training, layout)[choose_cp_comm(model, training, layout)]
        comm["cp"] = link("cp", 2).seconds(exchange * layers * m, 3 * (layout.cp - 1) * layers * m)
    if layout.dp_shard == 1 and layout.dp * layout.cp > 1:
        n = layout.dp * layout.cp
        buckets = max(1, math.ceil(grad_bytes / (bucket_mb * 2**20)))
        comm["dp"] = link("dp" if layout.dp > 1 else "cp", n).seconds(2 * (n - 1) / n * grad_bytes, buckets)
    if layout.dp_shard > 1:  # per block: gathered for forward (and again for backward without pp), reduce-scattered
        n, units = layout.dp_shard * layout.cp, layers + 1
        gathers = 1 if layout.pp > 1 else 2
        comm["dp_shard"] = (link("dp_shard", n, "all_gather").seconds((n - 1) / n * gathers * params * e,
                                                                      gathers * units)
                            + link("dp_shard", n, "reduce_scatter").seconds((n - 1) / n * grad_bytes, units))
        if layout.dp > 1:  # the replicas all-reduce their shards
            comm["dp"] = link("dp", layout.dp).seconds(2 * (layout.dp - 1) / layout.dp * grad_bytes / n, units)
    if layout.pp > 1:  # activations forward, their gradients backward, per micro-batch and boundary
        boundary = activation / (tp if training.sequence_parallel else 1)
        sends = 2 * m * (2 if layout.pp > 2 else 1)
        comm["pp"] = link("pp", 2).seconds(sends * boundary, sends)
    return comm


def _step_collectives(training: Training, layout: Layout, machine: Machine) -> float:
    """Seconds per step of the small collectives outside the blocks, each at its group's latency: the strategy's
    step agreement over the world (asynchronous: hidden where the machine overlaps), the token-mean loss's count
    over the ranks that split the batch and tp's vocabulary-parallel cross entropy (two) per micro-batch, cp's
    loss and logged values (two), the pipeline's results from the last stage (two broadcasts), and per value the
    step logs with ``sync_dist=True`` Lightning's barrier and all-reduce over the replicas (under tp the loss
    gathered first). Counted in the strategy's steps (docs/planner.md)."""
    m = _microbatches(training, layout)
    synced = training.synced_logs
    per_group = ((layout.devices, 0 if machine.overlap else 1), (layout.data_parallel * layout.cp, m),
                 (layout.tp, 2 * m + synced), (layout.cp, 2), (layout.pp, 2), (layout.data_parallel, 2 * synced))
    return sum(count * machine.link(size, size > machine.devices_per_node).latency_s
               for size, count in per_group if size > 1 and count)


def _exposed(comm: dict[str, float], machine: Machine, layout: Layout, work: float, backward: float,
             attention: float, m: int, layers: int, buckets: float) -> dict[str, float]:
    """What of each axis's communication the step waits for: all of it without overlap; with it, what the
    compute it runs beside does not cover (tp's all-reduces are always waited for)."""
    if not machine.overlap:
        return dict(comm)
    exposed = dict(comm)
    if "dp" in comm:  # the buckets all-reduce during the backward; the last one after it
        exposed["dp"] = max(comm["dp"] / max(1.0, math.ceil(buckets)), comm["dp"] - backward)
    if "dp_shard" in comm:  # prefetched: only the first block's gather waits
        exposed["dp_shard"] = max(comm["dp_shard"] / (layers + 1), comm["dp_shard"] - work)
    if "cp" in comm:  # the ring's next exchange runs beside this tile's attention
        exposed["cp"] = max(comm["cp"] / (3 * (layout.cp - 1) * layers * m), comm["cp"] - attention)
    if "pp" in comm:  # steady-state transfers run beside the next micro-batch; warm-up and cool-down wait
        exposed["pp"] = comm["pp"] * min(1.0, (layout.pp - 1) / m)
    return exposed


def check_machine(machine: Machine) -> None:
    """The figures a prediction divides by are positive (a PlanError naming the one that is not)."""
    for name, value in (("memory_bandwidth", machine.memory_bandwidth), *machine.matmul_flops.items()):
        if not value > 0:
            raise PlanError(f"machine {name}={value!r} must be positive: calibrate again (python -m lightning_4d.plan"
                            " --measure) or give the figure.")
    if not machine.links:
        raise PlanError("the machine has no measured link: calibrate with python -m lightning_4d.plan --measure.")
