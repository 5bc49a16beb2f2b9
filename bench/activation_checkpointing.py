"""Activation checkpointing: peak memory of a training step and its time, per mode and sequence length.

    OMP_NUM_THREADS=1 python bench/activation_checkpointing.py [--seq 256 512 1024] [--steps 3]

One process trains the example GPT (8 blocks, width 128, 8 heads, vocabulary 256, a batch of 4 sequences,
AdamW, fp32) with each ``FourDStrategy(activation_checkpointing=...)`` mode applied to its blocks exactly as the
strategy applies it (``lightning_4d.memory.activation_checkpointing``), at each ``--seq`` length. Per mode and length:

* ``peak``: the step's peak memory above what the process held before the forward (the resident set's
  high-water mark, ``lightning_4d.observability.telemetry.PeakMemory``; the script re-runs itself with a fixed mmap threshold
  so that the resident set follows live tensors), the largest of the ``--steps`` steps;
* ``step``: wall time of forward, backward and optimizer step, the median of ``--steps`` after one warm-up,
  and the process's CPU time per step beside it (the machine is shared: wall time swings, CPU time less).

Results in ``bench/results/activation_checkpointing.json``.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CPU_MALLOC_ENV, command, write  # noqa: E402

if any(os.environ.get(key) != value for key, value in CPU_MALLOC_ENV.items()):  # before torch allocates anything
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CPU_MALLOC_ENV})

import torch  # noqa: E402

from lightning_4d.memory.activation_checkpointing import MODES, ActivationCheckpointConfig, apply_activation_checkpointing  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d.observability.telemetry import PeakMemory  # noqa: E402

BATCH = 4


def measure(mode: str, seq: int, steps: int) -> dict:
    torch.manual_seed(0)
    module = GPT(vocab_size=256, n_layer=8, n_head=8, n_embd=128, block_size=seq)
    apply_activation_checkpointing(list(enumerate(module.model.layers)), ActivationCheckpointConfig(mode))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
    memory = PeakMemory(torch.device("cpu"))
    peaks, walls, cpus = [], [], []
    for step in range(steps + 1):
        optimizer.zero_grad(set_to_none=True)
        memory.start()
        wall, cpu = time.perf_counter(), time.process_time()
        module._loss((tokens[:, :-1], tokens[:, 1:])).backward()  # training_step without a Trainer to log to
        optimizer.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if step:  # the first step allocates the optimizer's state
            peaks.append(memory.growth())
            walls.append(wall)
            cpus.append(cpu)
    return {"mode": mode, "seq": seq, "peak_mib": max(peaks) / 2**20, "step_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = [measure(mode, seq, args.steps) for seq in args.seq for mode in MODES]
    print("| seq | mode | peak MiB | of none | step s | of none | CPU s/step |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        none = next(r for r in rows if r["seq"] == row["seq"] and r["mode"] == "none")
        print(f"| {row['seq']} | {row['mode']} | {row['peak_mib']:.1f} | {row['peak_mib'] / none['peak_mib']:.2f} |"
              f" {row['step_s']:.3f} | {row['step_s'] / none['step_s']:.2f} | {row['cpu_s']:.3f} |")
    path = write("activation_checkpointing", {"command": command("activation_checkpointing.py"), "rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
