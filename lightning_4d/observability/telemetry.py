"""Training telemetry as a Lightning callback: throughput, model FLOPs utilization, peak memory, communication
time per mesh dimension and the pipeline bubble, written to the Trainer's loggers.

Every ``log_every_n_steps`` training batches (the Trainer's value by default) the callback logs, under
``telemetry/``, the window's averages over all ranks; the first batch of a fit (start-up, warm-up) is never
part of a window. See ``docs/telemetry.md`` for what each value means and how it is measured:

* tokens: the first integer tensor of each batch (``input_ids``), counted after the strategy moved it, times
  the ranks that hold different tokens: ``dp * cp`` under :class:`~lightning_4d.FourDStrategy` (context
  parallelism shards the sequence on transfer, so each cp rank counts its shard), every rank otherwise.
* model FLOPs: ``6 * N`` per token, ``N`` the parameters that multiply (embedding tables, being lookups, are
  left out; a tied embedding counts once, as the head), plus attention measured from the shapes of every
  scaled-dot-product-attention kernel the step runs, counting only the query/key pairs a causal mask keeps,
  times 3 for forward and backward. Recomputation is not model FLOPs and is counted only if it recomputes
  attention through these kernels.
* peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak resident set elsewhere.
* communication: wall time blocked in ``torch.distributed`` process-group calls, in ``Work.wait()`` and in
  functional collectives (DTensor), attributed to the mesh dimension of the group. On NCCL, where waits do
  not block the host, this is the host-side cost only.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_4d import _compat as compat

# Dense peak FLOP/s per device by name (vendor datasheets, without sparsity): (16-bit, TF32, FP32).
PEAK_FLOPS: tuple[tuple[str, float, Optional[float], Optional[float]], ...] = (
    (r"GH200", 989.4e12, 494.7e12, 67e12),
    (r"H100.*PCIe", 756e12, 378e12, 51.2e12),
    (r"H100 NVL", 835e12, 417.5e12, 60e12),
    (r"H100|H800", 989.4e12, 494.7e12, 66.9e12),
    (r"H200", 989.4e12, 494.7e12, 66.9e12),
    (r"B200", 2250e12, 1100e12, None),
    (r"A100|A800", 312e12, 156e12, 19.5e12),
    (r"L40S", 362.05e12, 183e12, 91.6e12),
    (r"L40\b", 181e12, 90.5e12, 90.5e12),
    (r"\bL4\b", 121e12, 60e12, 30.3e12),
    (r"\bA10\b", 125e12, 62.5e12, 31.2e12),
    (r"V100", 125e12, None, 15.7e12),
    (r"RTX 4090", 165.2e12, 82.6e12, 82.6e12),
    (r"MI300X", 1307.4e12, 653.7e12, 163.4e12),
)

# Forward attention kernels and the position of their ``is_causal`` argument. Context parallelism's ring
# calls the aten kernels blockwise; plain code calls the first, which dispatches to one of the others.
_ATTENTION: dict[Any, int] = {F.scaled_dot_product_attention: 5, **compat.ATTENTION_KERNELS}
# A group with one dim's ranks is that dim's; the first dim here wins a member set several dims share (under
# sharding alone, every data-parallel collective is sharding's: FSDP's all-gathers and reduce-scatters).
_DIM_PRECEDENCE = ("dp_shard", "dp", "cp", "tp", "pp", "dp_cp", "dp_replicate")
_GROUP_OF = {"dp_shard": "dp_shard_cp"}  # FSDP shards over dp_shard x cp
OTHER = "other"
_PENDING_KEPT = 4096  # labels of collectives issued and not yet waited for


def peak_flops_for(device_name: str, precision: str) -> Optional[float]:
    """Dense peak FLOP/s of one device for a Lightning precision string, or None when not in the table.

    32-bit precisions use the TF32 peak when torch lets matmuls use TF32, the FP32 peak otherwise."""
    if "64" in str(precision):
        return None
    for pattern, half, tf32, fp32 in PEAK_FLOPS:
        if re.search(pattern, device_name):
            if "16" in str(precision):
                return half
            return tf32 if torch.get_float32_matmul_precision() != "highest" and tf32 else fp32
    return None


def count_tokens(batch: Any) -> int:
    """Elements of the batch's first integer tensor (depth first), 0 if it has none."""
    if isinstance(batch, torch.Tensor):
        integer = not (batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool)
        return batch.numel() if integer and batch.dim() else 0
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) and not \
        isinstance(batch, str) else ()
    for item in items:
        tokens = count_tokens(item)
        if tokens:
            return tokens
    return 0


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool) -> float:
    """Forward FLOPs of attention: ``q @ k^T`` and ``p @ v`` over the query/key pairs the mask keeps."""
    lq, lk = query.shape[-2], key.shape[-2]
    if is_causal:  # torch's causal mask is aligned top-left: query i sees keys 0..i
        pairs = lq * (lq + 1) // 2 if lq <= lk else lk * (lk + 1) // 2 + (lq - lk) * lk
    else:
        pairs = lq * lk
    heads = query.numel() // (lq * query.shape[-1])  # batch x query heads
    return 2.0 * heads * pairs * (query.shape[-1] + value.shape[-1])


def matmul_params(module: nn.Module) -> dict[str, int]:
    """Full (DTensor: global) sizes of the parameters that multiply, by name; embedding-only ones left out."""
    lookup_only = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(False)}
    used_elsewhere = {id(p) for m in module.modules() if not isinstance(m, nn.Embedding)
                      for p in m.parameters(False)}
    return {name: p.numel() for name, p in module.named_parameters()
            if id(p) not in lookup_only or id(p) in used_elsewhere}


class _Stopwatch:
    """Seconds blocked in communication, by label; the process-group and Work patches feed it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.enabled = False
        self.labels: dict[str, Optional[str]] = {}  # process-group name -> label
        self.dim_ranks: dict[tuple[int, ...], str] = {}  # member ranks -> label
        self._pending: dict[int, Optional[str]] = {}  # id of a Work or a functional collective's output -> label
        self._saved: list[tuple[type, str, Any]] = []

    def label(self, group: Any) -> Optional[str]:
        """The dim whose ranks the group holds, ``"other"``, or None for a group of one rank (no traffic)."""
        name = group.group_name
        if name not in self.labels:
            try:
                ranks = tuple(dist.get_process_group_ranks(group))
            except (KeyError, ValueError, RuntimeError):
                ranks = ()
            self.labels[name] = None if len(ranks) == 1 else self.dim_ranks.get(ranks, OTHER)
        return self.labels[name]

    def add(self, label: Optional[str], seconds: float) -> None:
        if self.enabled and label is not None:
            self.seconds[label] = self.seconds.get(label, 0.0) + seconds

    def started(self, token: Any, label: Optional[str]) -> None:
        self._pending[id(token)] = label
        if len(self._pending) > _PENDING_KEPT:  # works nobody waits for: forget the oldest
            del self._pending[next(iter(self._pending))]

    def finished(self, token: Any) -> Optional[str]:
        return self._pending.pop(id(token), OTHER)

    def reset(self) -> None:
        """A new window. Collectives in flight keep their labels: one issued in the last step of a window may be
        waited for in the next (the pipeline's results are)."""
        self.seconds = {}

    def install(self) -> None:
        watch = self

        def timed_call(original):
            def call(group, *args, **kwargs):
                start = time.perf_counter()
                work = original(group, *args, **kwargs)
                label = watch.label(group)
                watch.add(label, time.perf_counter() - start)
                if work is not None:
                    watch.started(work, label)
                return work
            return call

        def timed_wait(original):
            def wait(work, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return original(work, *args, **kwargs)
                finally:
                    watch.add(watch.finished(work), time.perf_counter() - start)
            return wait

        for name in compat.PROCESS_GROUP_METHODS:
            if name in vars(dist.ProcessGroup):
                self._patch(dist.ProcessGroup, name, timed_call(getattr(dist.ProcessGroup, name)))
        self._patch(dist.Work, "wait", timed_wait(dist.Work.wait))

    def _patch(self, cls: type, name: str, replacement: Any) -> None:
        self._saved.append((cls, name, vars(cls)[name]))
        setattr(cls, name, replacement)

    def uninstall(self) -> None:
        while self._saved:
            cls, name, original = self._saved.pop()
            setattr(cls, name, original)


class _StepMode(TorchFunctionMode):
    """Active during each training batch: counts attention FLOPs and times functional collectives."""

    def __init__(self, watch: _Stopwatch, labels_by_name: dict[str, Optional[str]]) -> None:
        super().__init__()
        self.watch = watch
        self.labels_by_name = labels_by_name
        self.attention_flops = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", func)
        if packet in _ATTENTION:
            position = _ATTENTION[packet]
            causal = kwargs.get("is_causal", args[position] if len(args) > position else False)
            query, key, value = (list(args[:3]) + [kwargs.get(k) for k in ("query", "key", "value")][len(args):])[:3]
            if query.device.type != "meta":  # a shape check (context parallelism's, on meta tensors) computes nothing
                self.attention_flops += attention_flops(query, key, value, bool(causal))
        elif type(packet) is compat.OpOverloadPacket and compat.op_qualified_name(packet).startswith(
                compat.FUNCTIONAL_COLLECTIVE_NAMESPACES):
            return self._collective(packet, func, args, kwargs)
        return func(*args, **kwargs)

    def _collective(self, packet: Any, func: Any, args: tuple, kwargs: dict) -> Any:
        waiting = compat.op_qualified_name(packet).endswith("::wait_tensor")
        if waiting:
            label = self.watch.finished(args[0] if args else kwargs.get("tensor"))
        else:
            names = [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
            if not names:  # a helper of the namespace (wrapping a result for autograd), not communication
                return func(*args, **kwargs)
            label = self.labels_by_name.get(names[-1], OTHER)
        start = time.perf_counter()
        output = func(*args, **kwargs)
        self.watch.add(label, time.perf_counter() - start)
        if not waiting:
            for tensor in output if isinstance(output, (list, tuple)) else (output,):
                self.watch.started(tensor, label)
        return output


class PeakMemory:
    """Peak memory of this process since ``start()``, for telemetry, benchmarks and the planner's tests.

    On CUDA: bytes allocated by tensors. Elsewhere torch keeps no allocator statistics, so it is the
    resident set: on Linux its high-water mark ``VmHWM``, which ``start()`` restarts through
    ``/proc/self/clear_refs``; on other systems the peak since the process started. ``growth()`` is the peak
    above what the process held at ``start()``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = float(torch.cuda.memory_allocated(self.device))
        elif sys.platform.startswith("linux"):
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # restarts the high-water mark VmHWM
            self.baseline = _proc_status("VmRSS")

    def peak(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        if sys.platform.startswith("linux"):
            return _proc_status("VmHWM")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)

    def growth(self) -> float:
        return self.peak() - self.baseline


def _proc_status(key: str) -> float:
    """A size from Linux's ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            name, value = line.split(":", 1)
            if name == key:
                return float(value.split()[0]) * 1024
    raise KeyError(key)


class Telemetry(Callback):
    """Logs ``telemetry/*`` throughput, MFU, peak memory, communication time per dim and pipeline bubble.

    Args:
        peak_flops: dense peak FLOP/s of one device, for MFU. ``None``: looked up by the CUDA device's name and
            the Trainer's precision (:data:`PEAK_FLOPS`); without a peak, MFU is not logged (TFLOP/s are).
        log_every_n_steps: training batches per logged window; ``None``: the Trainer's ``log_every_n_steps``.
        prefix: prepended to every metric name.
    """

    def __init__(self, peak_flops: Optional[float] = None, log_every_n_steps: Optional[int] = None,
                 prefix: str = "telemetry/") -> None:
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops={peak_flops!r} must be a positive number of FLOP/s per device, e.g."
                             " 989e12 for an H100 SXM in bf16, or None to look it up by device name.")
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool)
                                              or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be a positive integer or None.")
        self.peak_flops = peak_flops
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.last_metrics: dict[str, float] = {}  # the latest logged window, also on ranks that do not log
        self._watch = _Stopwatch()
        self._mode: Optional[_StepMode] = None
        self._active = False  # the mode is on the stack
        self._memory: Optional[PeakMemory] = None
        self._labels: list[str] = []
        self._ep_bytes_seen = 0.0  # expert parallelism's all-to-all bytes already in a window (or before any)
        self._replicas = 1
        self._matmul_params = 0
        self._peak: Optional[float] = None
        self._window_start: Optional[float] = None
        self._paused_at: Optional[float] = None
        self._batches = 0
        self._tokens = 0

    # ------------------------------------------------------------------------------------ fit lifecycle

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        dims = getattr(strategy, "parallel_dims", None)
        self._watch.labels.clear()
        self._watch.dim_ranks.clear()
        labels_by_name: dict[str, Optional[str]] = {}
        if dims is not None and dist.is_initialized():
            sharded = dims.dp_shard_enabled
            sizes = {"dp": dims.dp, "cp": dims.cp, "tp": dims.tp, "pp": dims.pp, "dp_cp": dims.dp * dims.cp,
                     "dp_shard": dims.dp_shard * dims.cp if sharded else 1,
                     "dp_replicate": dims.dp_replicate if sharded else 1}
            for dim in reversed(_DIM_PRECEDENCE):  # the first dim of the precedence wins a shared member set
                if sizes[dim] > 1:
                    group = strategy.mesh.group(_GROUP_OF.get(dim, dim))
                    self._watch.dim_ranks[tuple(dist.get_process_group_ranks(group))] = dim
            # A dim that lost its member set (dp_cp when only dp or only cp splits) gets no label of its own.
            winners = set(self._watch.dim_ranks.values())
            self._labels = [d for d in _DIM_PRECEDENCE if d in winners]
            for dim in _DIM_PRECEDENCE:
                if sizes[dim] > 1:
                    group = strategy.mesh.group(_GROUP_OF.get(dim, dim))
                    labels_by_name[group.group_name] = self._watch.label(group)
            if dims.ep_enabled:  # expert parallelism's all-to-all: by its group, whose members another dim may share
                group = strategy.mesh.group("ep")
                self._watch.labels[group.group_name] = labels_by_name[group.group_name] = "ep"
                self._labels.append("ep")
            self._replicas = dims.dp * dims.cp
        else:
            self._labels = ["world"] if trainer.world_size > 1 else []
            if dist.is_initialized():
                self._watch.dim_ranks[tuple(range(dist.get_world_size()))] = "world"
            self._replicas = trainer.world_size
        self._labels.append(OTHER)
        if dist.is_initialized():
            world = dist.group.WORLD
            labels_by_name[world.group_name] = self._watch.label(world)
        self._matmul_params = self._count_matmul_params(pl_module, strategy)
        device = strategy.root_device
        self._peak = self.peak_flops
        if self._peak is None and device.type == "cuda":
            self._peak = peak_flops_for(torch.cuda.get_device_name(device), str(trainer.precision))
        self._memory = PeakMemory(device)
        self._mode = _StepMode(self._watch, labels_by_name)
        self._window_start = None
        self._watch.install()

    @staticmethod
    def _count_matmul_params(pl_module: LightningModule, strategy: Any) -> int:
        """Over the whole model: pipeline stages hold different parameters, under their original names (the
        same on every other peer: DTensors count their global size), so a FourDStrategy gathers over pp only."""
        local = matmul_params(pl_module)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return sum(local.values())
        dims = getattr(strategy, "parallel_dims", None)
        if dims is not None and dims.pp == 1:
            return sum(local.values())
        group = strategy.mesh.group("pp") if dims is not None else None
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        merged = {name: size for sizes in everyone for name, size in sizes.items()}
        return sum(merged.values())

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._active:
            self._mode.__exit__(None, None, None)
            self._active = False
        self._watch.uninstall()
        self._watch.enabled = False
        self._window_start = None

    # ---------------------------------------------------------------------------------------- batches

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._tokens += count_tokens(batch)
        self._mode.__enter__()
        self._active = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._mode.__exit__(None, None, None)
        self._active = False
        if self._window_start is None:
            self._open_window()
            dispatchers = getattr(getattr(trainer.strategy, "parallel", None), "expert_dispatch", [])
            self._ep_bytes_seen = float(sum(d.sent_bytes for d in dispatchers))  # the first batch is no window's
            return
        self._batches += 1
        if self._batches >= (self.log_every_n_steps or trainer.log_every_n_steps):
            self._close_window(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation inside a training epoch is not training time: the window stops while it runs.
        if self._window_start is not None:
            self._watch.enabled = False
            self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._paused_at is not None:
            self._window_start += time.perf_counter() - self._paused_at
            self._paused_at = None
            self._watch.enabled = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._batches:
            self._close_window(trainer)

    def _open_window(self) -> None:
        self._synchronize()
        self._batches = self._tokens = 0
        self._mode.attention_flops = 0.0
        self._watch.reset()
        self._watch.enabled = True
        self._memory.start()
        self._window_start = time.perf_counter()

    def _close_window(self, trainer: Trainer) -> None:
        self._synchronize()
        elapsed = time.perf_counter() - self._window_start
        self._watch.enabled = False  # this window's own collectives are not training communication
        self.last_metrics = self._window_metrics(trainer, elapsed)
        for logger in trainer.loggers:
            logger.log_metrics(self.last_metrics, step=trainer.global_step)
        self._open_window()

    def _synchronize(self) -> None:
        if self._memory is not None and self._memory.device.type == "cuda":
            torch.cuda.synchronize(self._memory.device)

    def _window_metrics(self, trainer: Trainer, elapsed: float) -> dict[str, float]:
        world = trainer.world_size
        device = trainer.strategy.root_device
        comm = [self._watch.seconds.get(label, 0.0) for label in self._labels]
        dispatchers = getattr(getattr(trainer.strategy, "parallel", None), "expert_dispatch", [])
        sent = float(sum(d.sent_bytes for d in dispatchers))  # expert parallelism's all-to-all, since set-up
        ep_bytes, self._ep_bytes_seen = sent - self._ep_bytes_seen, sent
        sums = torch.tensor([float(self._tokens), self._mode.attention_flops, elapsed, *comm, ep_bytes],
                            dtype=torch.float64, device=device)
        peak = self._memory.peak()
        extremes = torch.tensor([peak, -peak], dtype=torch.float64, device=device)
        if dist.is_initialized() and world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        tokens_all_ranks, attention, elapsed_all_ranks, *comm_all_ranks, ep_bytes = sums.tolist()
        # Tokens each rank saw, over the ranks that see different ones: world / replicas ranks see each token.
        tokens = tokens_all_ranks * self._replicas / world
        elapsed = elapsed_all_ranks / world
        step_time = elapsed / self._batches
        flops = 6.0 * self._matmul_params * tokens + 3.0 * attention
        p = self.prefix
        metrics = {
            f"{p}step_time_s": step_time,
            f"{p}peak_memory_gib_max": extremes[0].item() / 2**30,
            f"{p}peak_memory_gib_min": -extremes[1].item() / 2**30,
        }
        if tokens:  # without token tensors in the batch there is nothing to count throughput in
            metrics[f"{p}tokens_per_s"] = tokens / elapsed
            metrics[f"{p}tokens_per_s_per_device"] = tokens / elapsed / world
            metrics[f"{p}flops_per_token"] = flops / tokens
            metrics[f"{p}tflops_per_device"] = flops / elapsed / world / 1e12
            if self._peak is not None:
                metrics[f"{p}mfu"] = flops / elapsed / world / self._peak
        for label, seconds in zip(self._labels, comm_all_ranks):
            metrics[f"{p}comm_s/{label}"] = seconds / world / self._batches
        if dispatchers:  # bytes each rank sent to the others of its expert group, per step
            metrics[f"{p}comm_bytes/ep"] = ep_bytes / world / self._batches
        if "pp" in self._labels:
            metrics[f"{p}pipeline_bubble"] = metrics[f"{p}comm_s/pp"] / step_time
        return metrics
