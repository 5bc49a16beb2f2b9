"""Pipeline schedules on the example GPT: step time, bubble fraction against theory, and the overhead of
FourDStrategy against the same torch schedule driven by hand on hand-split stages.

    OMP_NUM_THREADS=1 python bench/pp.py [--pp 2 4] [--steps 8] [--rounds 3] [--schedules gpipe 1f1b ...]
                                         [--ablation]

For each pipeline size the script starts itself with ``--worker`` (Lightning's launcher then starts the other
ranks). Each rank trains the example GPT through ``Trainer(strategy=FourDStrategy(pp=...))`` for every schedule and
micro-batch count, and, in the same processes, the same ``torch.distributed.pipelining`` schedule class on stages
cut by hand (embedding + blocks, blocks, blocks + norm + head, cross entropy as the schedule's loss), with the same
optimizer. Step time is the median after two warm-up steps, of the slowest rank. The hand-driven comparison runs at
``m = 2p`` for every schedule; there the runs alternate for ``--rounds`` rounds and each keeps its best. CPU time
per step (summed over ranks) is reported next to wall time: on a machine shared with other jobs it is the steadier
measure of extra work. The machine's speed also drifts over minutes, which the best of each moves with; the paired
overhead is the median over rounds of each round's FourD step against the hand-driven step of the same round,
seconds apart. A step's time runs from its start to its end; its period, from its start to the next step's start,
also holds what runs between the steps (for FourD, Lightning's loop): the paired period overhead is how much longer
per step a long run takes. The step-by-step overhead pairs closer still: in each round one more run takes FourD's
steps and hand-driven steps in turn (a hand step after each even FourD step and before each odd one, in the same
processes), and it is the median over every pair of the rounds of FourD's step against the hand step beside it,
milliseconds apart, with a 95% bootstrap interval of that median over the pairs, and the medians of the pairs in
either order (``_fourd_first``, ``_hand_first``): which side runs first moves a pair's ratio by several points
(``docs/performance-history.md``), so neither order alone is the overhead. ``--ablation`` adds such runs of FourD
without its fused LM head, without token-weighted losses, and without both (``ABLATION``): what each costs against
the hand stages.

A control measures what each estimate reads with no overhead at all: the hand-driven pipeline against itself. In
each round at ``m = 2p`` a second separate hand-driven run (``hand_control``, first in the round, so three runs
from the hand-driven run it is compared with, where FourD's run is two) gives the separate-run estimates
(``overhead_*_control``: best of each, paired, period), and a run of two hand-driven copies in turn gives the
step-by-step one (``overhead_wall_interleaved_control``). How far these stray from zero is how much of a
FourD figure the machine alone can make.

At ``m = 2p`` FourD runs twice: with its defaults, and with the LM head computed as the hand stages compute it
(``fuse_lm_loss=False``: the logits whole, then the cross entropy). The second is the pipeline's own overhead,
the same arithmetic on both sides; the first adds the fused head's, a memory feature whose time is measured on
its own by ``bench/logits.py``. Token-weighted losses stay on in both (FourD's default).

Bubble fraction: every rank times its stage's forward and backward calls (``PipelineStage.forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``); the rest of the step is waiting. The measured fraction
is ``1 - busy / step time``, averaged over ranks. Theory for GPipe and 1F1B: ``(p - 1) / (m + p - 1)``.
"""

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from bench.common import command, quiet_trainer, random_tokens, run_worker, write, write_rows  # noqa: E402
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.pipeline import SCHEDULES, PipelineConfig  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=8, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 16, 128
WARMUP = 2
TIMEOUT_S = 1800
# ``--ablation``: FourD interleaved with the hand-driven steps without what its defaults add to the hand stages'
# arithmetic: the fused LM head, token-weighted losses, or both (then the same arithmetic on both sides).
ABLATION = {"unfused": {"fuse_lm_loss": False}, "replica": {"loss_normalization": "replica"},
            "plain": {"fuse_lm_loss": False, "loss_normalization": "replica"}}

_busy = [0.0]  # seconds this rank spent inside its stages' forward and backward calls during the step


def _timed(method, into: list[float] = _busy):
    """``method`` adding the wall seconds of each call to ``into[0]``."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into[0] += time.perf_counter() - start

    return run


for _name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
    setattr(PipelineStage, _name, _timed(getattr(PipelineStage, _name)))


def _data(steps: int) -> TensorDataset:
    return random_tokens(BATCH * steps, SEQ, MODEL["vocab_size"])


class _Steps(Callback):
    """Per-step wall time, stage busy time and CPU time, after warm-up. With ``beside``, one step of that
    hand-driven pipeline next to each step, timed apart: after the even steps, before the odd ones, so that neither
    side always runs first. The two steps of a pair run milliseconds apart."""

    def __init__(self, beside: "_HandPipeline | None" = None) -> None:
        self.samples: list[tuple[float, float, float, float]] = []
        self.beside = beside
        self._start = (0.0, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.beside is not None and batch_idx % 2:
            self.beside.step(batch_idx)
        _busy[0] = 0.0
        self._previous, self._start = self._start[0], (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= WARMUP:  # the period: from the step before's start, Lightning's work between batches too
            self.samples.append((time.perf_counter() - self._start[0], _busy[0], time.process_time() - self._start[1],
                                 self._start[0] - self._previous))
        if self.beside is not None and not batch_idx % 2:
            self.beside.step(batch_idx)


def run_fourd(pp: int, schedule: str, micro: int, steps: int, beside: "_HandPipeline | None" = None,
              **options) -> list[tuple[float, float, float, float]]:
    pl.seed_everything(0, verbose=False)
    timer = _Steps(beside)
    trainer = quiet_trainer(accelerator="cpu", devices=pp, max_steps=WARMUP + steps, callbacks=[timer],
                            strategy=FourDStrategy(pp=pp, pp_schedule=schedule, pp_microbatches=micro, **options))
    trainer.fit(GPT(**MODEL), DataLoader(_data(WARMUP + steps), batch_size=BATCH))
    return timer.samples


class _HandStage(nn.Module):
    """One stage cut by hand, as a torchtitan-style model would be written for pipelining."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tok_emb = model.tok_emb if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in blocks)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("cos", model.cos, persistent=False)
        self.register_buffer("sin", model.sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(x) if self.first else x
        cos, sin = self.cos[:h.size(1)], self.sin[:h.size(1)]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h)) if self.last else h


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class _HandPipeline:
    """The same torch schedule class on stages cut by hand, with the same optimizer; one ``step`` at a time."""

    def __init__(self, pp: int, schedule: str, micro: int, steps: int) -> None:
        torch.manual_seed(0)
        model = GPT(**MODEL).model
        config = PipelineConfig(pp, schedule, micro)
        rank = dist.get_rank()
        bounds = config.stage_bounds(len(model.layers))
        local = [s for s, r in enumerate(config.stage_ranks()) if r == rank]
        modules = [_HandStage(model, range(*bounds[s]), s == 0, s == config.num_stages - 1) for s in local]
        stages = [PipelineStage(m, s, config.num_stages, torch.device("cpu")) for m, s in zip(modules, local)]
        spec = config.spec
        self.schedule = spec.cls(stages if spec.stages_per_rank != 1 else stages[0], micro, loss_fn=_loss)
        self.optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=3e-3, betas=(0.9, 0.95))
        self.data = _data(WARMUP + steps).tensors
        self.samples: list[tuple[float, float, float, float]] = []
        self._previous = 0.0

    def step(self, step: int) -> None:
        x, y = (t[step * BATCH:(step + 1) * BATCH] for t in self.data)
        _busy[0] = 0.0
        start = (time.perf_counter(), time.process_time())
        previous, self._previous = self._previous, start[0]
        self.optimizer.zero_grad()
        self.schedule.step(x, target=y)
        self.optimizer.step()
        if step >= WARMUP:
            self.samples.append((time.perf_counter() - start[0], _busy[0], time.process_time() - start[1],
                                 start[0] - previous))


def run_by_hand(pp: int, schedule: str, micro: int, steps: int) -> list[tuple[float, float, float, float]]:
    hand = _HandPipeline(pp, schedule, micro, steps)
    for step in range(WARMUP + steps):
        hand.step(step)
    return hand.samples


def run_interleaved(pp: int, schedule: str, micro: int, steps: int, **options) -> list[float]:
    """FourD's step and a hand-driven step in turn, in one run: each pair's ratio minus one, the slower rank's
    step on both sides. Pairs milliseconds apart leave out the drift of the machine that separate runs see;
    which side runs first alternates from pair to pair."""
    hand = _HandPipeline(pp, schedule, micro, steps)
    fourd = run_fourd(pp, schedule, micro, steps, beside=hand, **options)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [[t for t, *_ in fourd], [t for t, *_ in hand.samples]])
    return [max(r[0][i] for r in everyone) / max(r[1][i] for r in everyone) - 1 for i in range(steps)]


def run_interleaved_control(pp: int, schedule: str, micro: int, steps: int) -> list[float]:
    """The same pairs with the hand-driven pipeline on both sides (a second copy in place of FourD): what the
    step-by-step estimate reads when there is no overhead at all, its noise and any bias of the pairing."""
    first, second = _HandPipeline(pp, schedule, micro, steps), _HandPipeline(pp, schedule, micro, steps)
    for step in range(WARMUP + steps):
        for hand in ((first, second) if step % 2 == 0 else (second, first)):
            hand.step(step)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [[t for t, *_ in first.samples], [t for t, *_ in second.samples]])
    return [max(r[0][i] for r in everyone) / max(r[1][i] for r in everyone) - 1 for i in range(steps)]


def interval(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95% interval of the median of ``values`` (pairs drawn again with replacement, percentile bootstrap): how
    far the step-by-step overhead could move with other pairs of the same run."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def _summary(samples: list[tuple[float, float, float, float]]) -> dict[str, float]:
    """This rank's medians, then over ranks: the slowest step time, the mean bubble, the total CPU time, the
    slowest period (step start to step start)."""
    mine = [statistics.median(t for t, *_ in samples), 1 - statistics.median(b / t for t, b, *_ in samples),
            statistics.median(c for _, _, c, _ in samples), statistics.median(p for *_, p in samples)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"step_s": max(r[0] for r in everyone), "bubble": statistics.fmean(r[1] for r in everyone),
            "cpu_s": sum(r[2] for r in everyone), "period_s": max(r[3] for r in everyone)}


def theory(schedule: str, pp: int, micro: int) -> float | None:
    return (pp - 1) / (micro + pp - 1) if schedule in ("gpipe", "1f1b") else None


def worker(pp: int, steps: int, rounds: int, schedules: list[str], ablation: bool, out: str) -> None:
    variants = {"": {}, **(ABLATION if ablation else {})}
    rows = []
    for schedule in schedules:
        for micro in (pp, 2 * pp, 4 * pp):
            try:
                PipelineConfig(pp, schedule, micro)
            except ValueError:
                continue  # the schedule needs more micro-batches than this
            runs = {"fourd": lambda: run_fourd(pp, schedule, micro, steps)}
            if micro == 2 * pp:
                # the control: a hand-driven run three runs before the one FourD is compared with (FourD's is two)
                runs = {"hand_control": lambda: run_by_hand(pp, schedule, micro, steps), **runs}
                runs["fourd_unfused"] = lambda: run_fourd(pp, schedule, micro, steps, fuse_lm_loss=False)
                runs["by_hand"] = lambda: run_by_hand(pp, schedule, micro, steps)
            best: dict[str, dict[str, float]] = {}
            by_round: list[dict[str, dict[str, float]]] = []
            pairs: dict[str, list[list[float]]] = {v: [] for v in variants}  # per round, each pair's overhead
            control_pairs: list[list[float]] = []
            for _ in range(rounds if micro == 2 * pp else 1):
                by_round.append({})
                for name, run in runs.items():
                    result = by_round[-1][name] = _summary(run())
                    if name not in best or result["step_s"] < best[name]["step_s"]:
                        best[name] = result
                if micro == 2 * pp:
                    for variant, options in variants.items():
                        pairs[variant].append(run_interleaved(pp, schedule, micro, steps, **options))
                    control_pairs.append(run_interleaved_control(pp, schedule, micro, steps))
            row = {"pp": pp, "schedule": schedule, "microbatches": micro, "theory_bubble": theory(schedule, pp, micro),
                   **{f"{name}_{key}": value for name, result in best.items() for key, value in result.items()}}
            if "by_hand" in best:
                for name, suffix in (("fourd", ""), ("fourd_unfused", "_unfused"), ("hand_control", "_control")):
                    row[f"overhead_wall{suffix}"] = best[name]["step_s"] / best["by_hand"]["step_s"] - 1
                    row[f"overhead_cpu{suffix}"] = best[name]["cpu_s"] / best["by_hand"]["cpu_s"] - 1
                    # each round's runs follow each other within seconds: their ratio leaves out the machine's drift
                    row[f"overhead_wall_paired{suffix}"] = statistics.median(
                        r[name]["step_s"] / r["by_hand"]["step_s"] - 1 for r in by_round)
                    # the same from periods: what a run of many steps takes per step, Lightning's loop included
                    row[f"overhead_period_paired{suffix}"] = statistics.median(
                        r[name]["period_s"] / r["by_hand"]["period_s"] - 1 for r in by_round)
                for variant, by_pair in pairs.items():
                    key = "overhead_wall_interleaved" + (f"_{variant}" if variant else "")
                    row[key] = statistics.median(o for r in by_pair for o in r)
                    row[f"{key}_interval"] = interval([o for r in by_pair for o in r])
                    # the pairs whose FourD step ran first, and those whose hand step did: how much the order moves it
                    for order, first in (("fourd_first", 0), ("hand_first", 1)):
                        row[f"{key}_{order}"] = statistics.median(
                            o for r in by_pair for i, o in enumerate(r) if (WARMUP + i) % 2 == first)
                    row[f"{key}_rounds"] = [statistics.median(r) for r in by_pair]
                control = [o for r in control_pairs for o in r]
                row["overhead_wall_interleaved_control"] = statistics.median(control)
                row["overhead_wall_interleaved_control_interval"] = interval(control)
            rows.append(row)
    write_rows(rows, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--ablation", action="store_true", help="also interleave FourD without its defaults' extras")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.pp[0], args.steps, args.rounds, args.schedules, args.ablation, args.out)
        return
    rows = []
    for pp in args.pp:
        rows += run_worker(__file__, ["--pp", str(pp), "--steps", str(args.steps), "--rounds", str(args.rounds),
                                      "--schedules", *args.schedules, *(["--ablation"] if args.ablation else [])],
                           TIMEOUT_S)
    payload = {"command": command("pp.py"), "model": MODEL, "batch": BATCH, "seq_len": SEQ, "steps": args.steps,
               "rounds": args.rounds, "results": rows}
    print(table("pp", payload), f"\n(written to {write('pp', payload)})")


if __name__ == "__main__":
    main()
