"""Where a pipeline step's time goes: FourDStrategy against the same schedule driven by hand, phase by phase.

    OMP_NUM_THREADS=1 python bench/pp_phases.py [--schedule gpipe] [--pp 2] [--microbatches 4] [--steps 12]
                                                [--rounds 2]

``bench/pp.py`` gives the overhead; this says where it sits. Every rank, per step (medians after two warm-up
steps): the step's wall time, split into the time before the torch schedule's ``step`` (for the hand loop:
``zero_grad``; for FourD: Lightning's step start, splitting the batch, setting gradients aside), the schedule
and the time after it (for the hand loop: the optimizer step; for FourD: the results exchange, committing
gradients, the optimizer step and Lightning's step end); the CPU time of the step's own thread inside its
stages' forward calls (F) and backward calls (B: the input's and, for the zero-bubble schedules, the weights'
half) and in the whole schedule (gloo's I/O threads, which the process's CPU time would add in, are left out);
the wall time spent posting sends and receives (``isend`` / ``irecv`` return at once unless the process waits
for a core or a lock of the transport); and, for FourD, three parts of the time after the schedule: the last
stage's results reaching every stage (``exchange``), the step's ``self.log`` calls replayed through Lightning
(``replay``) and the gradients committed in Lightning's ``backward`` (``commit``). The same CPU times per stage
follow (F, B for the input, W for the weights): they show which stage's work differs. Three runs alternate for
``--rounds`` rounds in the same processes: FourD with its defaults, FourD with neither token-weighted losses nor
the fused LM head (``loss_normalization="replica"``, ``fuse_lm_loss=False``: the hand stages' arithmetic), and
the hand-driven stages of ``bench/pp.py``.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench import pp  # noqa: E402
from bench.common import command, quiet_trainer, run_worker, write, write_rows  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.numerics.step_logging import StepLogs  # noqa: E402
from lightning_4d.pipeline import SCHEDULES, PipelineConfig  # noqa: E402
from lightning_4d.pipeline.results import ResultExchange  # noqa: E402
from lightning_4d.pipeline.runner import PipelineRunner  # noqa: E402

TIMEOUT_S = 1800
RUNS = {"fourd": {}, "fourd_plain": {"loss_normalization": "replica", "fuse_lm_loss": False}, "by_hand": None}
# This step's CPU seconds inside each local stage's calls, by (kind, stage): F forward, B backward of the input
# (of everything, outside the zero-bubble schedules), W backward of the weights; and the wall seconds spent
# posting sends and receives.
_cpu: dict[tuple[str, int], float] = {}
_posting = [0.0]
_marks: list[tuple] = []
# This step's wall seconds in FourD's parts after the schedule (see the module docstring).
_parts = {"exchange": [0.0], "replay": [0.0], "commit": [0.0]}


def _cpu_timed(method, kind: str):
    def run(stage, *args, **kwargs):
        start = time.thread_time()
        try:
            return method(stage, *args, **kwargs)
        finally:
            key = (kind, stage.stage_index)
            _cpu[key] = _cpu.get(key, 0.0) + time.thread_time() - start

    return run


PipelineStage.forward_one_chunk = _cpu_timed(PipelineStage.forward_one_chunk, "F")
PipelineStage.backward_one_chunk = _cpu_timed(PipelineStage.backward_one_chunk, "B")
PipelineStage.backward_weight_one_chunk = _cpu_timed(PipelineStage.backward_weight_one_chunk, "W")
# torch.distributed.pipelining posts its operations through these names (``P2POp`` accepts only them, so both
# modules get the same wrapper).
dist.isend = c10d.isend = pp._timed(c10d.isend, _posting)
dist.irecv = c10d.irecv = pp._timed(c10d.irecv, _posting)
ResultExchange.exchange = pp._timed(ResultExchange.exchange, _parts["exchange"])
StepLogs.replay = pp._timed(StepLogs.replay, _parts["replay"])
PipelineRunner.commit_gradients = pp._timed(PipelineRunner.commit_gradients, _parts["commit"])


def _time_schedule(cls) -> None:
    step = cls.step

    def timed(self, *args, **kwargs):
        _cpu.clear()
        _posting[0] = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return step(self, *args, **kwargs)
        finally:
            _marks.append(("schedule", wall, time.perf_counter(), time.thread_time() - cpu, dict(_cpu),
                           _posting[0]))

    cls.step = timed


class _StepEnd(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for part in _parts.values():
            part[0] = 0.0
        _marks.append(("start", time.perf_counter()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _marks.append(("end", time.perf_counter(), {name: part[0] for name, part in _parts.items()}))


def _hand_step_timed(step):
    def run(self, *args, **kwargs):
        _marks.append(("start", time.perf_counter()))
        try:
            return step(self, *args, **kwargs)
        finally:
            _marks.append(("end", time.perf_counter()))

    return run


pp._HandPipeline.step = _hand_step_timed(pp._HandPipeline.step)


def _fourd(pp_size: int, schedule: str, micro: int, steps: int, options: dict) -> list[dict]:
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(accelerator="cpu", devices=pp_size, max_steps=pp.WARMUP + steps, callbacks=[_StepEnd()],
                            strategy=FourDStrategy(pp=pp_size, pp_schedule=schedule, pp_microbatches=micro, **options))
    trainer.fit(pp.GPT(**pp.MODEL), DataLoader(pp._data(pp.WARMUP + steps), batch_size=pp.BATCH))
    return _samples()


def _by_hand(pp_size: int, schedule: str, micro: int, steps: int) -> list[dict]:
    pp.run_by_hand(pp_size, schedule, micro, steps)
    return _samples()


def _samples() -> list[dict[str, float]]:
    """Each step's figures from its marks: the step's start, its schedule, the step's end."""
    marks = {kind: [m for m in _marks if m[0] == kind] for kind in ("start", "schedule", "end")}
    return [_sample(start[1], s, end) for start, s, end in zip(marks["start"], marks["schedule"], marks["end"])]


def _sample(begin: float, schedule: tuple, end: tuple) -> dict[str, float]:
    """One step's figures; per stage as ``F<stage>`` and so on; FourD's parts after the schedule (none by hand)."""
    _, start, stop, cpu, by_stage, posting = schedule
    _, finish, *parts = end
    sample = {"F": sum(t for (kind, _), t in by_stage.items() if kind == "F"),
              "B": sum(t for (kind, _), t in by_stage.items() if kind != "F"), "before": start - begin,
              "wall": stop - start, "cpu": cpu, "posting": posting, "after": finish - stop, "step": finish - begin,
              **(parts[0] if parts else dict.fromkeys(_parts, 0.0))}
    return {**sample, **{f"{kind}{stage}": t for (kind, stage), t in by_stage.items()}}


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
    print("| round | run | rank | step (ms) | before the schedule (ms) | schedule (ms) | after the schedule (ms) |"
          " F (ms CPU) | B (ms CPU) | schedule (ms CPU) | posting (ms) | exchange (ms) | replay (ms) | commit (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['run']} | {r['rank']} | {r['step']:.1f} | {r['before']:.1f} | {r['wall']:.1f} |"
              f" {r['after']:.1f} | {r['F']:.1f} | {r['B']:.1f} | {r['cpu']:.1f} | {r['posting']:.1f} |"
              f" {r['exchange']:.2f} | {r['replay']:.2f} | {r['commit']:.2f} |")
    print("\n| round | run | stage | F (ms CPU) | B (ms CPU) | W (ms CPU) |\n|---|---|---|---|---|---|")
    by_stage = sorted((r["round"], list(RUNS).index(r["run"]), int(key[1:]), r) for r in rows for key in r
                      if key[0] == "F" and key[1:].isdigit())
    for round_, _, stage, r in by_stage:
        print(f"| {round_} | {r['run']} | {stage} |"
              + "".join(f" {r[f'{kind}{stage}']:.1f} |" if f"{kind}{stage}" in r else " - |" for kind in "FBW"))
    path = write("pp_phases", {"command": command("pp_phases.py"), "model": pp.MODEL, "batch": pp.BATCH,
                               "seq_len": pp.SEQ, "results": rows})
    print(f"(written to {path})")


if __name__ == "__main__":
    main()
