"""Predicted against measured step time for every valid layout of a module, and what ``layout="auto"`` chooses.

    OMP_NUM_THREADS=1 python bench/step_time.py [--processes 4] [--steps 4] [--models small wide] [--trials 3]
                                          [--rounds 2] [--name step_time]

First the calibration probe measures this machine with ``--processes`` gloo processes
(``lightning_4d.planner.calibration.measure_here``, measured again, then cached for the runs below). Then, per
model, that many processes train every layout the planner and the strategy accept (the example GPT, sequences of
128 tokens, AdamW, fp32) as a Lightning user would: a DataLoader batch of ``16 / processes`` sequences per
replica, so the global batch is that times the layout's data-parallel size; each with the pipeline micro-batches
and activation checkpointing the planner chose for it, in a launch of its own (a process that had run other
layouts first stepped slower: dp=8 31% after seven layouts, 3.7x after 33): the median step after 2 warm-up
steps, the slowest rank's; and that ``--rounds`` times, each round launching every run once in the same order
(one launch of a layout stepped 1.6x another's of the same layout the same hour): a layout's time is the median
of its rounds. The planner predicts each from the model's sizes, the layout's global batch and the
calibration. Last, ``FourDStrategy(layout="auto")`` runs with the same loader: its choice, and that layout's
measured time per sample in its own launches, and in the sweep's, against the fastest layout's (the global
batches differ, so time per sample is what compares; it is also what the strategy ranks by); then the same with ``layout_trials=--trials`` (the predicted
fastest few each run a few steps first; 1: no trials run).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import accelerator, command, quiet_trainer, random_tokens, run_worker, write, write_rows  # noqa: E402
from bench.report import table  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402

MODELS = {"small": dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128),
          "wide": dict(vocab_size=256, n_layer=4, n_head=8, n_embd=512, block_size=128)}
SEQUENCES, SEQ, WARMUP = 16, 128, 2  # a loader batch of SEQUENCES / processes per replica
TIMEOUT_S = 3600


class _Steps(Callback):
    def __init__(self) -> None:
        self.steps, self._start = [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(time.perf_counter() - self._start)


def _measure(config: dict, sizes: dict, per_replica: int, steps: int, count: int) -> dict:
    pl.seed_everything(0, verbose=False)
    probe = _Steps()
    trainer = quiet_trainer(accelerator=accelerator(count), devices=count, strategy=FourDStrategy(**sizes),
                            max_steps=WARMUP + steps, callbacks=[probe])
    data = random_tokens(SEQUENCES * (WARMUP + steps) * 4, SEQ, config["vocab_size"])
    trainer.fit(GPT(**config), DataLoader(data, batch_size=per_replica))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, probe.steps[WARMUP:])
    step = statistics.median(max(per_rank) for per_rank in zip(*everyone))
    dims = trainer.strategy.parallel_dims
    chosen = {name: trainer.strategy.requested_sizes[name] for name in ("dp", "dp_shard", "pp", "cp", "tp")}
    return {"sizes": chosen, "step_s": step, "global_batch": per_replica * dims.dp,
            "activation_checkpointing": trainer.strategy.composition["activation_checkpointing"].mode,
            "microbatches": trainer.strategy.pp_config.microbatches}


def worker(model: str, runs: list[dict], steps: int, count: int, out: str) -> None:
    """Each of ``runs`` in turn: a layout's sizes, or ``{"layout": "auto", "layout_trials": k}``."""
    config = MODELS[model]
    rows = []
    for sizes in runs:
        if sizes.get("layout") == "auto":
            auto = _measure(config, sizes, SEQUENCES // count, steps, count)
            rows.append({"model": model, "auto": True, "layout_trials": sizes["layout_trials"], **auto})
            continue
        try:
            rows.append({"model": model, **_measure(config, sizes, SEQUENCES // count, steps, count)})
        except ValueError as error:  # the strategy refused it: recorded, not measured
            rows.append({"model": model, "sizes": sizes, "refused": str(error).splitlines()[0]})
    write_rows(rows, out)


def _predictions(model: str, count: int, machine) -> list:
    """The planner's estimate of every valid layout at its own global batch (the loader's per replica times its
    data-parallel size)."""
    from lightning_4d.planner import Model, PlanError, Training, plan
    from lightning_4d.planner.cli import build_module
    from lightning_4d.planner.estimate import all_layouts

    sizes = Model.from_module(build_module("lightning_4d.demos.gpt:GPT", MODELS[model]))
    estimates = []
    for replicas in sorted({layout.data_parallel for layout in all_layouts(count)}):
        try:
            planned = plan(sizes, Training(seq_len=SEQ, global_batch=SEQUENCES // count * replicas), count,
                           machine=machine)
        except PlanError:  # no layout runs at that global batch
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--name", default="step_time", help="results file: bench/results/<name>.json")
    parser.add_argument("--trials", type=int, default=3, help="layout_trials of the second layout=\"auto\" run")
    parser.add_argument("--rounds", type=int, default=2, help="launches of each run; its time: their median")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", default="small")
    parser.add_argument("--layouts", default="[]")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.model, json.loads(args.layouts), args.steps, args.processes, args.out)
        return
    from lightning_4d.planner.calibration import measure_here

    machine = measure_here(args.processes, use_cache=False)
    rows = []
    for model in args.models:
        predicted = {json.dumps({k: v for k, v in vars(est.layout).items() if v != 1 or k == "dp"}, sort_keys=True):
                     est for est in _predictions(model, args.processes, machine)}
        # each layout runs the variant predicted for it: its micro-batches and activation checkpointing
        runs = [{**json.loads(key), **_variant(est)} for key, est in predicted.items()]
        runs += [{"layout": "auto", "layout_trials": trials} for trials in dict.fromkeys((1, args.trials))]
        launches = []
        for _ in range(args.rounds):  # a launch each: a process that ran other layouts steps slower (+31% after 7)
            launches.append([row for run in runs for row in run_worker(
                __file__, ["--model", model, "--layouts", json.dumps([run]), "--processes", str(args.processes),
                           "--steps", str(args.steps)], TIMEOUT_S)])
        measured = [row for rounds in zip(*launches) for row in _median_of_rounds(rounds)]
        for row in measured:
            if row.get("auto") or "refused" in row:
                rows.append(row)
                continue
            key = json.dumps({k: v for k, v in row["sizes"].items() if v != 1 or k == "dp"}, sort_keys=True)
            est = predicted[key]
            row.update(predicted_s=est.step.total, error=est.step.total / row["step_s"] - 1,
                       predicted_parts=est.step.parts)
            rows.append(row)
    for model in args.models:
        timed = [r for r in rows if r["model"] == model and "error" in r]
        errors = [abs(r["error"]) for r in timed]

        def per_sample(row: dict) -> float:
            return row["step_s"] / row["global_batch"]

        fastest = min(timed, key=per_sample)
        chosen = []
        for auto in (r for r in rows if r["model"] == model and r.get("auto")):
            same = next((r for r in timed if r["sizes"] == auto["sizes"]), None)  # the choice in the sweep
            versus = f"{per_sample(same) / per_sample(fastest):.2f}x" if same else "not measured"
            chosen.append(f"layout_trials={auto['layout_trials']} chose {auto['sizes']}: in its own launches"
                          f" {per_sample(auto) * 1e3:.1f} ms per sample, {per_sample(auto) / per_sample(fastest):.2f}x"
                          f" the fastest per sample; in the sweep {versus}")
        print(f"{model}: median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%}; fastest"
              f" {fastest['sizes']}; " + "; ".join(chosen))
    payload = {"command": command("step_time.py"), "models": MODELS, "seq_len": SEQ,
               "batch_per_replica": SEQUENCES // args.processes,
               "processes": args.processes, "machine": machine.as_dict(), "results": rows}
    print(table("step_time", payload), f"\n(written to {write(args.name, payload)})")


if __name__ == "__main__":
    main()
