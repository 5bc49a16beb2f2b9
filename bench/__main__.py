"""Every benchmark under ``bench/`` in one command, with one JSON of all results, a Markdown summary and plots.

    python -m bench all [--quick]          # every benchmark
    python -m bench dp cp [--quick]        # some of them: dp tp pp cp memory scaling checkpoint async_checkpoint
                                           # activation_checkpointing compile big_model experts cp_step_check logits step_time

Each benchmark runs as its own script (``python bench/NAME.py ...``, which launches its own ranks), on CPU
with gloo and, when CUDA is available, a second time on the GPUs with NCCL (those that need no more processes
than there are GPUs; pp and cp measure CPU processes only). Results go to ``bench/results/``: each script's
``NAME.json`` (``NAME_gpu.json`` on GPUs), ``all.json`` (every result with the time it took and the load
average before and after it), ``summary.md`` (every table) and ``NAME.png``. ``--quick`` runs smoke-size
settings into ``bench/results/quick/`` instead, so that the full figures stay as they are.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import report
from bench.common import RESULTS, machine

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    title: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    processes: int  # the most it launches at once
    gpu: bool = True  # whether it measures GPUs when there are enough


BENCHMARKS = {
    "dp": Benchmark("Data parallelism: FourDStrategy(dp=2) vs Lightning DDPStrategy",
                    ("--steps", "20", "--rounds", "2"), ("--steps", "6", "--rounds", "1"), 2),
    "tp": Benchmark("Tensor parallelism: FourDStrategy(tp=2) vs ModelParallelStrategy with a hand-written plan",
                    ("--steps", "20", "--rounds", "2"), ("--steps", "6", "--rounds", "1"), 2),
    "pp": Benchmark("Pipeline parallelism: bubble per schedule vs theory",
                    ("--pp", "2", "--steps", "4", "--rounds", "1"),
                    ("--pp", "2", "--steps", "2", "--rounds", "1", "--schedules", "gpipe", "1f1b"), 4, gpu=False),
    "cp": Benchmark("Context parallelism: attention memory and time vs sequence length",
                    ("--seq", "2048", "4096", "8192", "16384", "--cp", "2", "4", "--variants", "single", "ring",
                     "a2a", "--iters", "1"),
                    ("--seq", "1024", "2048", "--cp", "2", "--variants", "single", "ring", "--iters", "1"), 4,
                    gpu=False),
    "memory": Benchmark("Memory per rank vs layout and model size, measured and planned",
                        ("--widths", "128", "256", "512"), ("--widths", "64", "--layouts", "single", "dp2", "pp2"),
                        8),
    "scaling": Benchmark("Weak scaling from 1 to 16 processes",
                         ("--steps", "4"), ("--steps", "2", "--layouts", "dp1", "dp2", "dp4"), 16),
    "checkpoint": Benchmark("Distributed checkpoint: save, load and bytes per rank",
                            ("--steps", "3", "--repeats", "3"), ("--steps", "2", "--repeats", "1"), 8),
    "async_checkpoint": Benchmark("Checkpoint saves that never stop training: sync against async saves per layout",
                                  ("--saves", "20", "--sync-saves", "5", "--rounds", "2"),
                                  ("--layouts", "dp2", "--saves", "3", "--sync-saves", "2"), 2),
    "step_time": Benchmark("Predicted against measured step time per layout, and layout=\"auto\"'s choice",
                           ("--processes", "4", "--steps", "4"), ("--processes", "2", "--steps", "2", "--cases",
                                                                   "small", "--trials", "2", "--rounds", "1"), 4,
                           gpu=False),
    "activation_checkpointing": Benchmark("Activation checkpointing: peak memory and step time per mode",
                                          ("--seq", "256", "512", "1024", "--steps", "3"),
                                          ("--seq", "128", "--steps", "1"), 1, gpu=False),
    "compile": Benchmark("Compile: step time eager vs compile=True per layout",
                         ("--steps", "12", "--rounds", "2"),
                         ("--steps", "6", "--rounds", "1", "--layouts", "dp2"), 2, gpu=False),
    "experts": Benchmark("Expert parallelism: state per rank, step time, traffic of an 8-expert MoE, ep vs dp",
                         ("--steps", "6"), ("--steps", "3", "--layouts", "single", "dp2ep2", "dp2"), 4, gpu=False),
    "cp_step_check": Benchmark("Context parallelism's step check: the first step and peak memory with it on and off",
                               ("--seq", "1024", "4096", "--rounds", "2"),
                               ("--seq", "256", "--hidden", "64", "--layers", "2", "--rounds", "1"), 2, gpu=False),
    "big_model": Benchmark("Models bigger than one rank: setup and training peak per rank, whole- vs meta-built",
                           ("--sizes", "0.6GB", "2GB", "--steps", "3"),
                           ("--sizes", "tiny", "--layouts", "single", "tp2", "tp2dp_shard2", "--steps", "2"), 4,
                           gpu=False),
    "logits": Benchmark("The LM head fused with its cross entropy: peak memory and step time vs tokens and vocabulary",
                        ("--seq", "1024", "4096", "16384", "--vocab", "32000", "128000", "--steps", "3"),
                        ("--seq", "1024", "--vocab", "32000", "--steps", "2"), 2, gpu=False),
}


def _run(name: str, key: str, bench: Benchmark, accelerator: str, quick: bool, env: dict) -> dict:
    """One benchmark in its own process; its result with the time it took and the machine's load."""
    args = bench.quick if quick else bench.full
    print(f"\n=== {name} on {accelerator}: python bench/{name}.py {' '.join(args)}", flush=True)
    load_before, start = os.getloadavg(), time.perf_counter()
    subprocess.run([sys.executable, str(HERE / f"{name}.py"), *args], check=True,
                   env=dict(env, BENCH_ACCELERATOR=accelerator))
    elapsed = time.perf_counter() - start
    print(f"=== {name} on {accelerator}: {elapsed:.0f} s", flush=True)
    return {"name": name, "accelerator": accelerator, "elapsed_s": elapsed, "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "result": json.loads((RESULTS / f"{key}.json").read_text())}


def _summary(runs: dict, total_s: float | None) -> str:
    info = machine()
    lines = ["# Benchmark results", "",
             f"Machine: {info['cores']} {info['cpu']} cores, torch {info['torch']}, GPU: {info['cuda'] or 'none'}."
             " Load average (1, 5, 15 min) before and after each benchmark below: the machine may be shared."]
    if total_s is not None:
        lines.append(f"`python -m bench all` took {total_s / 60:.1f} min.")
    for key, run in runs.items():
        bench = BENCHMARKS[run["name"]]
        before, after = (", ".join(f"{x:.1f}" for x in run[k]) for k in ("load_average_before", "load_average_after"))
        lines += ["", f"## {bench.title} ({run['accelerator']})", "",
                  f"`{run['result']['command']}`: {run['elapsed_s']:.0f} s, load average {before} before,"
                  f" {after} after.", "", report.table(run["name"], run["result"])]
        if (RESULTS / f"{key}.png").exists():
            lines += ["", f"![{key}]({key}.png)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", choices=["all", *BENCHMARKS])
    parser.add_argument("--quick", action="store_true", help="smoke-size settings, results in bench/results/quick")
    args = parser.parse_args()
    if args.quick and "BENCH_RESULTS" not in os.environ:  # the child scripts must see it before importing common
        os.environ["BENCH_RESULTS"] = str(RESULTS / "quick")
        os.execv(sys.executable, [sys.executable, "-m", "bench", *sys.argv[1:]])
    names = list(BENCHMARKS) if "all" in args.names else list(dict.fromkeys(args.names))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    everything = RESULTS / "all.json"
    stored = json.loads(everything.read_text()) if everything.exists() else {}
    runs = stored.get("runs", {})
    passes = ["cpu"] + (["gpu"] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    for accelerator in passes:
        for name in names:
            bench = BENCHMARKS[name]
            key = name if accelerator == "cpu" else f"{name}_gpu"
            if accelerator == "gpu" and (not bench.gpu or bench.processes > torch.cuda.device_count()):
                print(f"=== {name} on gpu: skipped ({'CPU only' if not bench.gpu else 'too few GPUs'})")
                continue
            runs[key] = _run(name, key, bench, accelerator, args.quick, env)
            report.plot(name, runs[key]["result"], RESULTS / f"{key}.png")
    total = time.perf_counter() - start if "all" in args.names else stored.get("total_s")
    everything.write_text(json.dumps({"machine": machine(), "quick": args.quick, "total_s": total, "runs": runs},
                                     indent=2))
    (RESULTS / "summary.md").write_text(_summary(runs, total))
    print(f"\nAll benchmarks: {time.perf_counter() - start:.0f} s; {everything}, {RESULTS / 'summary.md'}")


if __name__ == "__main__":
    main()
