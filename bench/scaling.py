"""Weak scaling from 1 to 16 processes: tokens/s of FourDStrategy(dp=n), and of 4D layouts, at a fixed
amount of work per process.

    OMP_NUM_THREADS=1 python bench/scaling.py [--layouts dp1 dp2 dp4 dp8 dp16 dp2pp2cp2tp2] [--steps 4]

The example GPT of ``bench/dp.py`` (4 layers, n_embd 128, 4 heads, vocabulary 256), sequence 128, AdamW. Every
process gets 8 sequences' worth of work per step: a replica of ``pp*cp*tp`` processes takes a batch of
``8*pp*cp*tp`` sequences, so a step processes ``8 * 128 * processes`` tokens whatever the layout. Layouts with
the same process count share one launch. Step time is rank 0's median after 2 warm-up steps. With more
processes than cores the processes share the cores, so throughput cannot grow past the core count: the
result also records the ideal for this machine, ``min(processes, cores)`` times the one-process throughput.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (StepTimer, accelerator, command, layout, layout_parser, processes,  # noqa: E402
                          quiet_trainer, random_tokens, run_layouts, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
PER_PROCESS, SEQ, WARMUP = 8, 128, 2
TIMEOUT_S = 900


def measure(spec: str, steps: int, count: int) -> dict:
    dims = layout(spec)
    per_replica = PER_PROCESS * count // dims.get("dp", 1)
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(warmup=WARMUP)
    trainer = quiet_trainer(accelerator=accelerator(count), devices=count, strategy=FourDStrategy(**dims),
                            max_steps=WARMUP + steps, callbacks=[timer])
    trainer.fit(GPT(**MODEL), DataLoader(random_tokens(PER_PROCESS * count * (WARMUP + steps), SEQ,
                                                       MODEL["vocab_size"]), batch_size=per_replica))
    return {"layout": spec, "processes": count, "step_s": timer.median,
            "tokens_per_s": PER_PROCESS * count * SEQ / timer.median}


def worker(specs: list[str], steps: int, count: int, out: str) -> None:
    rows = [measure(spec, steps, count) for spec in specs]
    write_rows(rows, out)


def main() -> None:
    args = layout_parser(["dp1", "dp2", "dp4", "dp8", "dp16", "dp2pp2cp2tp2"], steps=4).parse_args()
    if args.worker:
        worker(args.layouts, args.steps, args.processes, args.out)
        return
    rows = run_layouts(__file__, args.layouts, ["--steps", str(args.steps)], TIMEOUT_S)
    one = [row["tokens_per_s"] for row in rows if row["processes"] == 1]
    cores = os.cpu_count() or 1
    for row in rows:
        if one:
            row["speedup"] = row["tokens_per_s"] / one[0]
            row["ideal_speedup_here"] = min(row["processes"], cores)
    payload = {"command": command("scaling.py"), "model": MODEL, "sequences_per_process": PER_PROCESS,
               "seq_len": SEQ, "steps": args.steps, "cores": cores,
               "accelerator": accelerator(max(map(processes, args.layouts))), "results": rows}
    print(table("scaling", payload), f"\n(written to {write('scaling', payload)})")


if __name__ == "__main__":
    main()
