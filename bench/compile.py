"""torch.compile per dimension: step time of the example GPT, eager against ``compile=True``, two processes.

    OMP_NUM_THREADS=1 python bench/compile.py [--steps 12] [--rounds 2] [--layouts dp2 tp2 cp2 pp2]

Lightning's launcher re-runs this script in the second process; both walk the same list of runs. For each
layout, eager and compiled training alternate for ``--rounds`` rounds (dynamo's caches are reset before each
run, so every compiled run compiles its blocks afresh, as a new process would). Per run: the median wall and
CPU time of a step after three warm-up steps, and the first step's wall time, which holds the compilation.
The figures are the best round of each (the machine is shared); results in ``bench/results/compile.json``.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import CpuStepTimer, accelerator, command, layout, quiet_trainer, random_tokens, write  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 8, 128


def run(spec: str, compiled: bool, steps: int, device: str) -> tuple[dict, int]:
    torch._dynamo.reset()
    pl.seed_everything(0, verbose=False)
    model = GPT(**MODEL)
    sizes = layout(spec)
    data = DataLoader(random_tokens(BATCH * (steps + 1), SEQ, MODEL["vocab_size"]), batch_size=BATCH)
    clock = CpuStepTimer()
    trainer = quiet_trainer(accelerator=device, devices=2, max_steps=steps,
                            strategy=FourDStrategy(**sizes, compile=compiled))
    trainer.callbacks.append(clock)
    trainer.fit(model, data)
    return {"step_s": clock.median, "cpu_s": statistics.median(clock.cpu), "first_step_s": clock.first}, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=["dp2", "tp2", "cp2", "pp2"])
    args = parser.parse_args()
    device = accelerator(2)
    runs: dict[str, dict[str, list[dict]]] = {spec: {"eager": [], "compiled": []} for spec in args.layouts}
    rank = 0
    for _ in range(args.rounds):
        for spec in args.layouts:
            for mode in ("eager", "compiled"):
                result, rank = run(spec, mode == "compiled", args.steps, device)
                runs[spec][mode].append(result)
    if rank != 0:
        return
    rows = []
    for spec, modes in runs.items():
        best = {mode: min(results, key=lambda r: r["step_s"]) for mode, results in modes.items()}
        spread = {mode: max(r["step_s"] for r in results) / min(r["step_s"] for r in results) - 1
                  for mode, results in modes.items()}
        rows.append({"layout": spec, **{f"{mode}_{key}": value for mode, r in best.items() for key, value in r.items()},
                     "speedup": best["eager"]["step_s"] / best["compiled"]["step_s"],
                     "cpu_speedup": best["eager"]["cpu_s"] / best["compiled"]["cpu_s"],
                     "spread": max(spread.values())})
    print("| layout | eager step s | compiled step s | speed-up (wall) | eager CPU s | compiled CPU s |"
          " speed-up (CPU) | first compiled step s | round spread |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['eager_step_s']:.3f} | {r['compiled_step_s']:.3f} | {r['speedup']:.2f}x |"
              f" {r['eager_cpu_s']:.3f} | {r['compiled_cpu_s']:.3f} | {r['cpu_speedup']:.2f}x |"
              f" {r['compiled_first_step_s']:.1f} | {r['spread']:.0%} |")
    payload = {"command": command("compile.py"), "model": MODEL, "batch": BATCH, "seq_len": SEQ,
               "accelerator": device, "rows": rows}
    print(f"(written to {write('compile', payload)})")


if __name__ == "__main__":
    main()
