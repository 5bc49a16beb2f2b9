"""Predicted against measured step time for every valid layout of a module, and what ``layout="auto"`` chooses.

    OMP_NUM_THREADS=1 python bench/step_time.py [--processes 4] [--steps 4] [--cases small wide ...] [--trials 3]
                                          [--rounds 2] [--memory] [--name step_time]

First the calibration probe measures this machine with ``--processes`` gloo processes
(``lightning_4d.planner.calibration.measure_here``, measured again, then cached for the runs below). Then, per
case (``CASES``: a model, a sequence length and a memory per device: every layout fits; replicated AdamW state
does not, at 4 processes in 150 MiB, at 2 in 200, where 150 fits nothing; a long sequence's activations do not
unsharded), that many processes train every layout the planner
and the strategy accept and the planner fits in the memory (the example GPT, AdamW, fp32) as a Lightning user
would: a DataLoader batch of ``16 / processes`` sequences per replica, so the global batch is that times the
layout's data-parallel size; each with the pipeline micro-batches and activation checkpointing the planner chose
for it, in a launch of its own (a process that had run other layouts first stepped slower: dp=8 31% after seven
layouts, 3.7x after 33). Measured: the median step after 2 warm-up steps, the slowest rank's, and the largest
growth of a rank's resident set from before the module is built to the end of training (``VmHWM``: with
glibc's default allocator, what it keeps of freed memory counts; with ``--memory``, the probe and every run use
a fixed mmap threshold, ``CPU_MALLOC_ENV``, so that freed tensors leave the resident set, as bench/memory.py
measures, and their steps run slower: 1.0-1.6x here, an mmap per large tensor, so time with one run and measure
memory with the other. What the runtime allocates besides, gloo's buffers and Lightning's state, counts; the
planner does not model it). That ``--rounds`` times, each round launching every
run once in the same order (one launch of a layout stepped 1.6x another's of the same layout the same hour): a
layout's time is the median of its rounds. The planner predicts each from the model's sizes, the layout's global
batch and the calibration. Last, ``FourDStrategy(layout="auto")`` runs with the same loader and the case's
``memory_per_device``: its choice, its peak against that budget, and its measured time per sample in its own
launches, and that layout's in the sweep, against the fastest layout's (the global batches differ, so time per
sample is what compares; it is also what the strategy ranks by); then the same with ``layout_trials=--trials``
(the predicted fastest few each run a few steps first; 1: no trials run).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CPU_MALLOC_ENV, accelerator, command, proc_status, quiet_trainer, random_tokens, rss_bytes,  # noqa: E402
                          run_worker, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402

MODELS = {"small": dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128),
          "wide": dict(vocab_size=256, n_layer=4, n_head=8, n_embd=512)}
MiB = 2**20
# What each case trains: a model, its sequence length, and the memory per device it is given (None: no budget).
CASES = {"small": ("small", 128, None), "wide": ("wide", 128, None),
         # at 4 processes replicated AdamW state does not fit: dp=4 needs 274 MiB by the planner, 196 of it state
         "wide_150MiB": ("wide", 128, 150 * MiB),
         # the same at 2 processes, where 150 MiB fits no layout once the runtime is counted: dp=2 needs 386 MiB
         # by the planner, pp=2 175
         "wide_200MiB": ("wide", 128, 200 * MiB),
         # a long sequence's activations do not fit unsharded: dp=4 needs 172 MiB by the planner, 150 of them
         # activations
         "long_120MiB": ("small", 1024, 120 * MiB)}
SEQUENCES, WARMUP = 16, 2  # a loader batch of SEQUENCES / processes per replica
TIMEOUT_S = 3600


class _Steps(Callback):
    def __init__(self) -> None:
        self.steps, self._start = [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(time.perf_counter() - self._start)


def _measure(case: str, sizes: dict, per_replica: int, steps: int, count: int) -> dict:
    model, seq, budget = CASES[case]
    config = {**MODELS[model], "block_size": seq}
    pl.seed_everything(0, verbose=False)
    probe = _Steps()
    trainer = quiet_trainer(accelerator=accelerator(count), devices=count, strategy=FourDStrategy(**sizes),
                            max_steps=WARMUP + steps, callbacks=[probe])
    data = random_tokens(SEQUENCES * (WARMUP + steps) * 4, seq, config["vocab_size"])
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here: building, laying out, training
    start = rss_bytes()
    trainer.fit(GPT(**config), DataLoader(data, batch_size=per_replica))
    grown = proc_status("VmHWM")["VmHWM"] - start
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (probe.steps[WARMUP:], grown))
    step = statistics.median(max(per_rank) for per_rank in zip(*(times for times, _ in everyone)))
    dims = trainer.strategy.parallel_dims
    chosen = {name: trainer.strategy.requested_sizes[name] for name in ("dp", "dp_shard", "pp", "cp", "tp")}
    return {"sizes": chosen, "step_s": step, "global_batch": per_replica * dims.dp,
            "activation_checkpointing": trainer.strategy.composition["activation_checkpointing"].mode,
            "microbatches": trainer.strategy.pp_config.microbatches,
            "peak_growth_bytes": max(peak for _, peak in everyone), "memory_per_device": budget}


def worker(case: str, runs: list[dict], steps: int, count: int, out: str) -> None:
    """Each of ``runs`` in turn: a layout's sizes, or ``{"layout": "auto", "layout_trials": k}`` (given the case's
    memory per device)."""
    budget, rows = CASES[case][2], []
    for sizes in runs:
        auto = {"auto": True, "layout_trials": sizes["layout_trials"]} if sizes.get("layout") == "auto" else {}
        if auto:
            sizes = {**sizes, "memory_per_device": budget}
        try:
            rows.append({"model": case, **auto, **_measure(case, sizes, SEQUENCES // count, steps, count)})
        except ValueError as error:  # the strategy refused it (layout="auto": nothing fits): recorded, not measured
            rows.append({"model": case, **auto, "sizes": sizes, "refused": str(error).splitlines()[0]})
    write_rows(rows, out)


def _predictions(case: str, count: int, machine) -> list:
    """The planner's estimate of every valid layout that fits the case's memory per device, at its own global batch
    (the loader's per replica times its data-parallel size)."""
    from lightning_4d.planner import Model, PlanError, Training, plan
    from lightning_4d.planner.cli import build_module
    from lightning_4d.planner.estimate import all_layouts

    model, seq, budget = CASES[case]
    sizes = Model.from_module(build_module("lightning_4d.demos.gpt:GPT", {**MODELS[model], "block_size": seq}))
    estimates = []
    for replicas in sorted({layout.data_parallel for layout in all_layouts(count)}):
        try:
            planned = plan(sizes, Training(seq_len=seq, global_batch=SEQUENCES // count * replicas), count,
                           memory_per_device=budget, machine=machine)
        except PlanError:  # no layout runs (or fits) at that global batch
            continue
        estimates += [est for est in planned if est.layout.data_parallel == replicas]
    return sorted(estimates, key=lambda est: est.step.total / est.training.global_batch)


def _median_of_rounds(rounds: tuple) -> list[dict]:
    """One run's rows of every round as one: the median step, each round's beside it (``layout="auto"``'s rows
    each on its own where its rounds chose differently)."""
    if "refused" in rounds[0]:
        return [rounds[0]]
    if any(row["sizes"] != rounds[0]["sizes"] for row in rounds):
        return list(rounds)
    times = [row["step_s"] for row in rounds]
    return [{**rounds[0], "step_s": statistics.median(times), "rounds_s": times}]


def _variant(est) -> dict:
    """The strategy's arguments for what the planner chose beside the sizes (what ``layout="auto"`` adopts)."""
    variant = {"activation_checkpointing": est.training.activation_checkpointing}
    if est.layout.pp > 1 and est.training.microbatches is not None:
        variant["pp_microbatches"] = est.training.microbatches
    return variant


def _summary(case: str, rows: list[dict]) -> str:
    """The case's median error, its fastest layout per sample and its fewest bytes, and each ``layout="auto"``
    choice against the fastest (in its own launches and in the sweep's) and its peak against the budget."""
    timed = [r for r in rows if r["model"] == case and "error" in r]
    if not timed:
        return f"{case}: no layout fits"

    def per_sample(row: dict) -> float:
        return row["step_s"] / row["global_batch"]

    fastest = min(timed, key=per_sample)
    fewest = min(timed, key=lambda r: r["predicted_comm_bytes"] / r["global_batch"])
    text = (f"{case}: median |error| {statistics.median(abs(r['error']) for r in timed):.0%}, worst"
            f" {max(abs(r['error']) for r in timed):.0%}; fastest {fastest['sizes']}, fewest bytes per sample"
            f" {fewest['sizes']} ({per_sample(fewest) / per_sample(fastest):.2f}x the fastest)")
    budget = CASES[case][2]
    for auto in (r for r in rows if r["model"] == case and r.get("auto")):
        if "refused" in auto:
            text += f"; layout_trials={auto['layout_trials']} refused: {auto['refused']}"
            continue
        same = next((r for r in timed if r["sizes"] == auto["sizes"]), None)  # the choice in the sweep
        versus = f"{per_sample(same) / per_sample(fastest):.2f}x" if same else "not measured"
        within = f" of {budget / MiB:.0f} MiB" if budget else ""
        text += (f"; layout_trials={auto['layout_trials']} chose {auto['sizes']}: in its own launches"
                 f" {per_sample(auto) * 1e3:.1f} ms per sample, {per_sample(auto) / per_sample(fastest):.2f}x the"
                 f" fastest; in the sweep {versus}; peak +{auto['peak_growth_bytes'] / MiB:.0f} MiB{within}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cases", nargs="+", default=[case for case in CASES if case != "wide_200MiB"],
                        choices=list(CASES), help="default: every case but wide_200MiB (for 2 processes)")
    parser.add_argument("--name", default="step_time", help="results file: bench/results/<name>.json")
    parser.add_argument("--trials", type=int, default=3, help="layout_trials of the second layout=\"auto\" run")
    parser.add_argument("--rounds", type=int, default=2, help="launches of each run; its time: their median")
    parser.add_argument("--memory", action="store_true", help="a fixed mmap threshold: peaks follow live tensors")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--case", default="small")
    parser.add_argument("--layouts", default="[]")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.case, json.loads(args.layouts), args.steps, args.processes, args.out)
        return
    from lightning_4d.planner.calibration import measure_here

    if args.memory:
        os.environ.update(CPU_MALLOC_ENV)  # the probe's processes and every run's, started from here
    machine = measure_here(args.processes, use_cache=False)
    rows = []
    for case in args.cases:
        predicted = {json.dumps({k: v for k, v in vars(est.layout).items() if v != 1 or k == "dp"}, sort_keys=True):
                     est for est in _predictions(case, args.processes, machine)}
        # each layout runs the variant predicted for it: its micro-batches and activation checkpointing
        runs = [{**json.loads(key), **_variant(est)} for key, est in predicted.items()]
        runs += [{"layout": "auto", "layout_trials": trials} for trials in dict.fromkeys((1, args.trials))]
        launches = []
        for _ in range(args.rounds):  # a launch each: a process that ran other layouts steps slower (+31% after 7)
            launches.append([row for run in runs for row in run_worker(
                __file__, ["--case", case, "--layouts", json.dumps([run]), "--processes", str(args.processes),
                           "--steps", str(args.steps)], TIMEOUT_S)])
        measured = [row for rounds in zip(*launches) for row in _median_of_rounds(rounds)]
        for row in measured:
            if not row.get("auto") and "refused" not in row:
                key = json.dumps({k: v for k, v in row["sizes"].items() if v != 1 or k == "dp"}, sort_keys=True)
                est = predicted[key]
                row.update(predicted_s=est.step.total, error=est.step.total / row["step_s"] - 1,
                           predicted_parts=est.step.parts, predicted_memory_bytes=est.memory["total"],
                           predicted_comm_bytes=est.comm["total"])
            rows.append(row)
    for case in args.cases:
        print(_summary(case, rows))
    malloc = dict(CPU_MALLOC_ENV) if args.memory else "glibc default"
    payload = {"command": command("step_time.py"), "models": MODELS, "cases": CASES, "malloc": malloc,
               "batch_per_replica": SEQUENCES // args.processes,
               "processes": args.processes, "machine": machine.as_dict(), "results": rows}
    print(table("step_time", payload), f"\n(written to {write(args.name, payload)})")


if __name__ == "__main__":
    main()
