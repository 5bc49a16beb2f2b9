"""What every rank must decide alike at a step's end (preempt? did a replica's data run out?), agreed without
making the GPU wait for the host.

The flags a step ends on are known on the host when the step starts: a preemption signal came or not, and the
data fetcher, which looks one batch ahead, knows whether this batch is the epoch's last. So one small
all-reduce (MAX) is launched as the step starts and read as it ends. On CUDA its input is staged in pinned
host memory and copied in without blocking, and its result is copied back into pinned memory behind an event:
reading it at the step's end waits at most for the GPU to reach the start of this step (the work before it),
never for the step itself, so the host may run a step ahead as it does without us. Its cost is one collective
of three integers per step, whatever the world's size. On CPU (gloo) the collective runs on gloo's thread and
the step's end waits for it.

What it does not tell, which ranks asked or ran out, is gathered only on the path that stops the run.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


class StepAgreement:
    """One MAX all-reduce of a few host integers per step over ``group``: :meth:`start` when the step starts,
    :meth:`result` when it ends. Every rank must call both at the same steps."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.group, self.device = group, device
        self._pinned = device.type == "cuda"
        self._work: Optional[dist.Work] = None
        self._host: Optional[Tensor] = None  # where the result is read on the host
        self._ready: Optional[torch.cuda.Event] = None

    @property
    def started(self) -> bool:
        """Whether this step's agreement was launched and not yet read."""
        return self._work is not None

    def start(self, values: list[int]) -> None:
        """Launch the step's agreement on ``values`` (each rank's own; the result is their maximum)."""
        if self._work is not None:
            self._work.wait()  # a step that never ended (a hook skipped the rest of the epoch): keep the order
        staged = torch.tensor(values, dtype=torch.int64, pin_memory=self._pinned)
        on_device = staged.to(self.device, non_blocking=True)
        self._work = dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if self._pinned:
            self._work.wait()  # on NCCL: the current stream waits for the collective; the host does not
            self._host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
            self._host.copy_(on_device, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = on_device

    def result(self) -> list[int]:
        """The maximum of every rank's values for the step :meth:`start` began."""
        if self._work is None or self._host is None:
            raise RuntimeError("StepAgreement.result() before start(): every step's agreement starts with the step.")
        if self._ready is not None:
            self._ready.synchronize()  # the copy behind this step's start, not the step
        else:
            self._work.wait()
        host = self._host
        self._work = self._host = self._ready = None
        return host.tolist()  # host memory (pinned on CUDA): no device read
