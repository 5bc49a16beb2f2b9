"""Pipeline options, checked when ``FourDStrategy`` is constructed: a bad value fails before processes start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)


class ScheduleSpec(NamedTuple):
    """How a torch schedule places stages on ranks, which the split must follow."""

    cls: type
    v_shape: bool  # stages go down the ranks and back up (rank 0 holds the first and the last stage)
    stages_per_rank: Optional[int]  # fixed by the schedule; None: ``pp_virtual_stages`` (default 2)
    forwards_first: bool  # each stage runs every micro-batch's forward before the first backward: all are held


SCHEDULES = {
    "gpipe": ScheduleSpec(ScheduleGPipe, False, 1, True),
    "1f1b": ScheduleSpec(Schedule1F1B, False, 1, False),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, False, None, False),
    "looped_bfs": ScheduleSpec(ScheduleLoopedBFS, False, None, True),
    "interleaved_zero_bubble": ScheduleSpec(ScheduleInterleavedZeroBubble, False, None, False),
    "zbv_zero_bubble": ScheduleSpec(ScheduleZBVZeroBubble, True, 2, False),
    "dualpipev": ScheduleSpec(ScheduleDualPipeV, True, 2, False),
}


@dataclass(frozen=True)
class PipelineConfig:
    """The ``pp_*`` options of ``FourDStrategy``, validated on construction. ``schedule``: ``gpipe``, ``1f1b``,
    ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``, ``zbv_zero_bubble`` or ``dualpipev``
    (torch's class-style names, such as ``Interleaved1F1B``, too)."""

    pp: int
    schedule: str = "1f1b"
    microbatches: Optional[int] = None  # default 2 * pp
    blocks: Optional[str] = None  # dotted path of the block list; found automatically if None
    split_points: Optional[tuple[int, ...]] = None  # first block of every stage but the first
    virtual_stages: Optional[int] = None

    def __post_init__(self) -> None:
        # torch's class-style names ("Interleaved1F1B", "ZBVZeroBubble") are accepted too.
        names = {name.replace("_", ""): name for name in SCHEDULES}
        key = self.schedule.lower().replace("_", "") if isinstance(self.schedule, str) else None
        if key not in names:
            raise ValueError(f"pp_schedule={self.schedule!r} is not a known schedule: use one of"
                             f" {', '.join(SCHEDULES)}.")
        object.__setattr__(self, "schedule", names[key])
        spec = SCHEDULES[self.schedule]
        if self.virtual_stages is not None:
            fixed = spec.stages_per_rank
            if isinstance(self.virtual_stages, bool) or not isinstance(self.virtual_stages, int) \
                    or self.virtual_stages < 1 or fixed not in (None, self.virtual_stages):
                need = f"exactly {fixed}" if fixed else "a positive integer"
                raise ValueError(f"pp_virtual_stages={self.virtual_stages!r} does not fit pp_schedule="
                                 f"{self.schedule!r}: it needs {need} stages per rank. Leave it unset for the default.")
        m = self.microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"pp_microbatches={m!r} must be a positive integer (default 2*pp = {2 * self.pp}).")
        self._check_microbatches()
        if self.blocks is not None and (not isinstance(self.blocks, str) or not self.blocks):
            raise ValueError(f"pp_blocks={self.blocks!r} must be the dotted path of the block list, e.g."
                             " 'model.layers', or None to find it automatically.")
        if self.split_points is not None:
            given = self.split_points
            points = list(given) if isinstance(given, (list, tuple)) else [None]
            object.__setattr__(self, "split_points", tuple(points))
            if (len(points) != self.num_stages - 1 or any(isinstance(p, bool) or not isinstance(p, int) for p in points)
                    or any(b <= a for a, b in zip([0, *points], points))):
                raise ValueError(
                    f"pp_split_points={given!r} must be {self.num_stages - 1} strictly increasing positive block"
                    f" indices (where stages 1..{self.num_stages - 1} begin: pp={self.pp} x {self.stages_per_rank}"
                    f" stages per rank), or None for an even split.")

    def _check_microbatches(self) -> None:
        m, pp, name = self.num_microbatches, self.pp, self.schedule
        problem = None
        if name == "1f1b" and m < pp:
            problem = f"1f1b needs at least pp={pp} micro-batches"
        elif name.startswith("interleaved") and m % max(1, m // pp):
            problem = f"{name} runs micro-batches in rounds of pp={pp}: use at most {pp}, or a multiple of {pp}"
        elif name in ("dualpipev", "zbv_zero_bubble") and m < self.num_stages:
            problem = f"{name} needs at least as many micro-batches as stages ({self.num_stages})"
        if problem:
            raise ValueError(f"pp_microbatches={m} does not fit pp_schedule={name!r}: {problem}.")

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    @property
    def stages_per_rank(self) -> int:
        return self.spec.stages_per_rank or self.virtual_stages or 2

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_ranks(self) -> list[int]:
        """The pipeline rank of every stage, as the torch schedule of this name expects it."""
        if not self.spec.v_shape:
            return [s % self.pp for s in range(self.num_stages)]
        return [s if s < self.pp else 2 * self.pp - 1 - s for s in range(self.num_stages)]

    def stage_bounds(self, num_blocks: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` block range of every stage."""
        if self.split_points is not None:
            starts = [0, *self.split_points]
        else:
            base, extra = divmod(num_blocks, self.num_stages)
            starts = [s * base + min(s, extra) for s in range(self.num_stages)]
        return list(zip(starts, [*starts[1:], num_blocks]))
