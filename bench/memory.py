"""Peak memory per rank against the layout, over a sweep of model sizes, next to the planner's estimate.

    OMP_NUM_THREADS=1 python bench/memory.py [--widths 128 256 512] [--layouts single dp2 tp2 pp2 cp2 dp2pp2cp2]
                                             [--steps 2]

The example GPT (8 layers, 8 heads, vocabulary 256) at each ``--widths`` (n_embd) trains ``--steps`` steps
of a global batch of 8 sequences of 128 tokens (AdamW, fp32) under each layout. Layouts with the same process
count share one launch, one Trainer after another. Each rank measures its peak above what it held right before
the model was built (``lightning_4d.observability.telemetry.PeakMemory``: on CPU the resident-set high-water mark with a fixed mmap
threshold, so that it follows live tensors); the figure is the largest rank's. The estimate is
``lightning_4d.planner.estimate`` for the same model, batch and layout: model state, gradient buckets and
activations on the heaviest pipeline stage, computed without running anything.
"""

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CPU_MALLOC_ENV, accelerator, by_processes, command, layout, layout_parser,  # noqa: E402
                          quiet_trainer, random_tokens, run_layouts, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.planner import Layout, Model, Training, estimate  # noqa: E402
from lightning_4d.observability.telemetry import PeakMemory  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=8, n_head=8, block_size=128)
GLOBAL_BATCH, SEQ = 8, 128
TIMEOUT_S = 900


class _Peak(Callback):
    """Every rank's peak, read when training ends (before Lightning's teardown frees anything)."""

    def __init__(self, memory: PeakMemory) -> None:
        self.memory = memory
        self.ranks: list[int] = []

    def on_train_end(self, trainer, pl_module):
        self.ranks = [0] * trainer.world_size
        if dist.is_initialized():
            dist.all_gather_object(self.ranks, self.memory.growth())
        else:
            self.ranks = [self.memory.growth()]


def measure(width: int, spec: str, steps: int, processes: int) -> dict:
    dims = layout(spec)
    device = accelerator(processes)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    memory = PeakMemory(torch.device("cuda", local_rank) if device == "gpu" else torch.device("cpu"))
    gc.collect()
    pl.seed_everything(0, verbose=False)
    memory.start()
    model = GPT(n_embd=width, **MODEL)
    peak = _Peak(memory)
    per_replica = GLOBAL_BATCH // dims.get("dp", 1)
    trainer = quiet_trainer(accelerator=device, devices=processes, strategy=FourDStrategy(**dims),
                            max_steps=steps, callbacks=[peak])
    trainer.fit(model, DataLoader(random_tokens(GLOBAL_BATCH * steps, SEQ, MODEL["vocab_size"]),
                                  batch_size=per_replica))
    reference = GPT(n_embd=width, **MODEL)  # unsharded, for the planner
    estimated = estimate(Model.from_module(reference), Training(seq_len=SEQ, global_batch=GLOBAL_BATCH),
                         Layout(**dims)).memory["total"]
    return {"width": width, "params": sum(p.numel() for p in reference.parameters()), "layout": spec, "processes": processes, "measured_mib_per_rank": [b / 2**20 for b in peak.ranks],
            "measured_mib": max(peak.ranks) / 2**20, "estimated_mib": estimated / 2**20}


def worker(widths: list[int], specs: list[str], steps: int, processes: int, out: str) -> None:
    rows = [measure(width, spec, steps, processes) for width in widths for spec in specs]
    write_rows(rows, out)


def main() -> None:
    parser = layout_parser(["single", "dp2", "tp2", "pp2", "cp2", "dp2pp2cp2"], steps=2)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512])
    args = parser.parse_args()
    if args.worker:
        worker(args.widths, args.layouts, args.steps, args.processes, args.out)
        return
    rows = run_layouts(__file__, args.layouts, ["--widths", *map(str, args.widths), "--steps", str(args.steps)],
                       TIMEOUT_S, CPU_MALLOC_ENV)
    rows.sort(key=lambda row: (row["width"], args.layouts.index(row["layout"])))
    for row in rows:
        row["estimate_error"] = row["estimated_mib"] / row["measured_mib"] - 1
    payload = {"command": command("memory.py"), "model": MODEL, "global_batch": GLOBAL_BATCH, "seq_len": SEQ,
               "steps": args.steps, "accelerator": accelerator(max(by_processes(args.layouts))), "results": rows}
    print(table("memory", payload), f"\n(written to {write('memory', payload)})")


if __name__ == "__main__":
    main()
