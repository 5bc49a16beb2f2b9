"""Where a pipeline step's time goes: FourDStrategy against the same schedule driven by hand, phase by phase.

    OMP_NUM_THREADS=1 python bench/pp_phases.py [--schedule gpipe] [--pp 2] [--microbatches 4] [--steps 12]
                                                [--rounds 2]

``bench/pp.py`` gives the overhead; this says where it sits. Every rank, per step (medians after two warm-up
steps): the CPU time inside its stages' forward calls (F) and backward calls (B), the torch schedule's ``step``
in wall and CPU time, and the time from the schedule's end to the step's end (for the hand loop: the optimizer
step; for FourD: committing gradients, the optimizer step, the results exchange and Lightning's step end). Three
runs alternate for ``--rounds`` rounds in the same processes: FourD with its defaults, FourD with neither
token-weighted losses nor the fused LM head (``loss_normalization="replica"``, ``fuse_lm_loss=False``: the hand
stages' arithmetic), and the hand-driven stages of ``bench/pp.py``.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench import pp  # noqa: E402
from bench.common import command, quiet_trainer, run_worker, write, write_rows  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.pipeline import SCHEDULES, PipelineConfig  # noqa: E402

TIMEOUT_S = 1800
RUNS = {"fourd": {}, "fourd_plain": {"loss_normalization": "replica", "fuse_lm_loss": False}, "by_hand": None}
_cpu = {"F": 0.0, "B": 0.0}  # this rank's CPU seconds in its stages' forward and backward calls, this step
_marks: list[tuple] = []


def _cpu_timed(method, key: str):
    def run(*args, **kwargs):
        start = time.process_time()
        try:
            return method(*args, **kwargs)
        finally:
            _cpu[key] += time.process_time() - start

    return run


PipelineStage.forward_one_chunk = _cpu_timed(PipelineStage.forward_one_chunk, "F")
PipelineStage.backward_one_chunk = _cpu_timed(PipelineStage.backward_one_chunk, "B")


def _time_schedule(cls) -> None:
    step = cls.step

    def timed(self, *args, **kwargs):
        _cpu["F"] = _cpu["B"] = 0.0
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return step(self, *args, **kwargs)
        finally:
            _marks.append(("schedule", wall, time.perf_counter(), time.process_time() - cpu, _cpu["F"], _cpu["B"]))

    cls.step = timed


class _StepEnd(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _marks.append(("end", time.perf_counter()))


def _fourd(pp_size: int, schedule: str, micro: int, steps: int, options: dict) -> list[dict]:
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(accelerator="cpu", devices=pp_size, max_steps=pp.WARMUP + steps, callbacks=[_StepEnd()],
                            strategy=FourDStrategy(pp=pp_size, pp_schedule=schedule, pp_microbatches=micro, **options))
    trainer.fit(pp.GPT(**pp.MODEL), DataLoader(pp._data(pp.WARMUP + steps), batch_size=pp.BATCH))
    schedules, ends = [m for m in _marks if m[0] == "schedule"], [m[1] for m in _marks if m[0] == "end"]
    return [dict(F=s[4], B=s[5], wall=s[2] - s[1], cpu=s[3], after=end - s[2]) for s, end in zip(schedules, ends)]


def _by_hand(pp_size: int, schedule: str, micro: int, steps: int) -> list[dict]:
    pp.run_by_hand(pp_size, schedule, micro, steps)
    schedules = [m for m in _marks if m[0] == "schedule"]
    # the hand loop's step after its schedule is the optimizer step: up to the next schedule's start
    return [dict(F=s[4], B=s[5], wall=s[2] - s[1], cpu=s[3], after=following[1] - s[2])
            for s, following in zip(schedules, schedules[1:])]


def worker(pp_size: int, schedule: str, micro: int, steps: int, rounds: int, out: str) -> None:
    _time_schedule(PipelineConfig(pp_size, schedule, micro).spec.cls)
    rows = []
    for round_ in range(rounds):
        for name, options in RUNS.items():
            _marks.clear()
            samples = (_by_hand(pp_size, schedule, micro, steps) if options is None
                       else _fourd(pp_size, schedule, micro, steps, options))[pp.WARMUP:]
            mine = {key: statistics.median(s[key] for s in samples) * 1000 for key in samples[0]}
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            rows += [{"round": round_, "run": name, "rank": rank, **values} for rank, values in enumerate(everyone)]
    write_rows(rows, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.pp, args.schedule, args.microbatches, args.steps, args.rounds, args.out)
        return
    rows = run_worker(__file__, ["--schedule", args.schedule, "--pp", str(args.pp), "--microbatches",
                                 str(args.microbatches), "--steps", str(args.steps), "--rounds", str(args.rounds)],
                      TIMEOUT_S)
    print("| round | run | rank | F (ms CPU) | B (ms CPU) | schedule (ms) | schedule (ms CPU) | after the schedule (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['run']} | {r['rank']} | {r['F']:.1f} | {r['B']:.1f} | {r['wall']:.1f} |"
              f" {r['cpu']:.1f} | {r['after']:.1f} |")
    path = write("pp_phases", {"command": command("pp_phases.py"), "model": pp.MODEL, "batch": pp.BATCH,
                               "seq_len": pp.SEQ, "results": rows})
    print(f"(written to {path})")


if __name__ == "__main__":
    main()
