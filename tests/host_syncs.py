"""What a training step makes the host wait for, counted per step and attributed to the code that asked.

A GPU trainer's host runs ahead of the device until something needs a device value on the host. On CPU nothing
waits, so the counter looks at the calls themselves, during the steps it is told to watch:

* device-to-host reads: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``),
  ``aten.equal`` (``torch.equal`` answers on the host) and the ops whose output size depends on values
  (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats), seen by a
  ``TorchDispatchMode``; ``.tolist()``, ``.cpu()``,
  ``.numpy()``, ``.item()``, which on CPU never reach the dispatcher, seen by wrapping them;
* tensors built from host data: ``torch.tensor``, ``torch.as_tensor``, ``Tensor.new_tensor``;
* collectives through ``torch.distributed``: synchronous ones (no ``async_op=True``), object collectives and
  barriers; asynchronous ones and torch's functional collectives (waited for on the device) are listed apart.

Each call is attributed to the innermost frame outside torch: ``lightning_4d``, ``lightning``, ``transformers``,
or ``other`` (the module or test). Nested calls (``all_gather_object`` calling ``all_gather``) count once.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

READ_OPS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "repeat_interleave", "nonzero_static"}
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
BARRIERS = ("barrier", "monitored_barrier")
TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                      "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
                      "all_to_all", "all_to_all_single", "send", "recv")
ASYNC_POINT_TO_POINT = ("batch_isend_irecv",)  # isend/irecv stay as they are: P2POp checks their identity
PACKAGES = ("lightning_4d", "lightning", "transformers", "peft")

# Where lightning_4d reads or builds host values in a step without touching the device: its pinned staging copies
# (faults/agreement.py), on CUDA copies to and from pinned memory behind events (bench/gpu_step.py checks it under
# torch.cuda.set_sync_debug_mode("error")), and a host tensor's value. On CPU every tensor is a host tensor, so
# these are named here.
STAGING = ("lightning_4d/faults/agreement.py",
           # the micro-batch index the pipeline schedule hands each stage: a CPU tensor it splits, never on the device
           "lightning_4d/pipeline/runner.py:forward",
           # context parallelism's masks decide which attention tiles to compute on their host twins (made from the
           # batch before it went to the device; the device copy is never read there)
           "lightning_4d/context_parallel/sequence_mask.py:seen_in",
           "lightning_4d/context_parallel/sequence_mask.py:pads",
           "lightning_4d/context_parallel/sequence_mask.py:splits_documents",
           # and lay out a packed batch by its documents, from the same host copy of its ids
           "lightning_4d/context_parallel/document_layout.py:piece_work",
           # the masks' device checks, read a step later (on CUDA from pinned memory behind an event)
           "lightning_4d/context_parallel/masks.py:read")
# Reads torch itself makes of a tensor it built on the host, named by (file, function) of the frame that reads:
# DTensor computes a strided shard's offsets (sequence parallelism's all-gather before the LM head) from a CPU
# ``torch.arange``. Counted as staging for whoever called torch.
TORCH_HOST_READS = {("torch/distributed/tensor/placement_types.py", "local_shard_size_and_offset")}


# The Strategy methods Lightning calls for the user (``self.log(sync_dist=True)``, ``self.all_gather``, ...): what
# they issue is counted for their caller.
STRATEGY_API = {"reduce", "all_gather", "barrier", "broadcast", "reduce_boolean_decision", "all_gather_ddp_if_available"}


def origin(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(package, "path:function") of the innermost frame outside torch and this file; the example models under
    ``lightning_4d/demos/`` count as a user's model ("other"), the Strategy API as its caller, and what torch's
    FSDP calls itself as torch's."""
    here = os.path.abspath(__file__)
    caller = next((f for f in reversed(stack) if os.path.abspath(f.filename) != here), None)
    if caller is not None and "/torch/distributed/fsdp/" in caller.filename.replace("\\", "/"):
        # FSDP's own all-gathers and reduce-scatters (on GPUs they run on its streams): torch's, whoever ran it
        return "torch", f"torch/distributed/fsdp/{os.path.basename(caller.filename)}:{caller.name}"
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or os.path.abspath(frame.filename) == here or path.endswith("/contextlib.py"):
            continue
        if "/lightning_4d/" in path and frame.name in STRATEGY_API and (
                path.endswith("/strategy.py") or "/lightning_4d/_compat/" in path):
            continue
        if frame.name in ("__torch_function__", "__torch_dispatch__") and (frame.line or "").strip().startswith("return func("):
            continue  # a torch-function mode passing a call through: the call is its caller's
        if "/lightning_4d/demos/" in path:
            return "other", f"demos/{os.path.basename(path)}:{frame.name}"
        for package in PACKAGES:
            marker = f"/{package}/"
            if marker in path:
                return package, f"{package}/{path.rsplit(marker, 1)[1]}:{frame.name}"
        return "other", f"{os.path.basename(path)}:{frame.name}"
    return "other", "?"


class _ReadMode(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READ_OPS and not (name == "repeat_interleave" and not isinstance(args[0], torch.Tensor)
                                     or name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else
                                                                                   kwargs.get("repeats"), int)):
            self.counter.note("read", f"aten.{name}")
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Counts while ``active``; ``counts[(kind, package, site, what)]``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.active = False
        self._inside = threading.local()
        self._undo: list[Callable[[], None]] = []
        self._mode = _ReadMode(self)

    def note(self, kind: str, what: str) -> None:
        if not self.active or getattr(self._inside, "depth", 0):
            return
        stack = traceback.extract_stack()
        package, site = origin(stack)
        if kind in ("read", "host_tensor") and any(part in site for part in STAGING):
            kind = "staging"
        reader = stack[-3]  # the frame that called the wrapper (this method's caller is the wrapper)
        if kind == "read" and any(reader.filename.replace("\\", "/").endswith(path) and reader.name == function
                                  for path, function in TORCH_HOST_READS):
            kind = "staging"
        self.counts[(kind, package, site, what)] += 1

    def _wrap(self, owner: Any, name: str, kind: Callable[[tuple, dict], str]) -> None:
        original = getattr(owner, name)
        counter = self

        def wrapper(*args, **kwargs):
            counter.note(kind(args, kwargs), name)
            counter._inside.depth = getattr(counter._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._inside.depth -= 1

        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        for name in ("tolist", "cpu", "numpy", "item"):
            self._wrap(torch.Tensor, name, lambda a, k: "read")
        for name in ("tensor", "as_tensor"):
            self._wrap(torch, name, lambda a, k: "host_tensor")
        self._wrap(torch.Tensor, "new_tensor", lambda a, k: "host_tensor")
        for name in OBJECT_COLLECTIVES:
            self._wrap(dist, name, lambda a, k: "object_collective")
        for name in BARRIERS:
            self._wrap(dist, name, lambda a, k: "barrier")
        for name in TENSOR_COLLECTIVES:
            self._wrap(dist, name, lambda a, k: "async_collective" if k.get("async_op") else "sync_collective")
        for name in ASYNC_POINT_TO_POINT:
            self._wrap(dist, name, lambda a, k: "async_collective")
        import torch.distributed._functional_collectives as functional
        for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
                     "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd"):
            self._wrap(functional, name, lambda a, k: "functional_collective")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def start(self) -> None:
        self.active = True
        self._mode.__enter__()

    def stop(self) -> None:
        self._mode.__exit__(None, None, None)
        self.active = False


class CountSteps(Callback):
    """Counts over training batches ``first``..``last`` of the fit (0-based): from the end of batch ``first - 1``
    (after every callback's hook there: the fault callback, added first, ends its step before this one) to the
    end of batch ``last``, so each counted step is whole, its start hooks and the strategy's included."""

    def __init__(self, first: int = 3, last: int = 8) -> None:
        self.first, self.last = first, last
        self.counter = SyncCounter()
        self.batches = 0

    def setup(self, trainer, pl_module, stage):
        self.counter.install()

    def teardown(self, trainer, pl_module, stage):
        self.counter.uninstall()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the fit's batch count, not batch_idx: that starts again each epoch (a run with accumulation has several)
        self.batches += 1
        if self.batches == self.last + 1:
            self.counter.stop()
        if self.batches == self.first:
            self.counter.start()

    def per_step(self) -> list[dict[str, Any]]:
        steps = self.last - self.first + 1
        return [dict(kind=kind, package=package, site=site, what=what, per_step=count / steps)
                for (kind, package, site, what), count in sorted(self.counts.items())]

    @property
    def counts(self) -> Counter:
        return self.counter.counts
