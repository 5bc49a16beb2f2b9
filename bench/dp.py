"""FourDStrategy(dp=2) against Lightning's DDPStrategy: same model, same batches, two processes.

    OMP_NUM_THREADS=1 python bench/dp.py [--steps 30] [--rounds 2] [--bucket-mb 0.05 --layers 8]

Lightning's launcher re-runs this script in the second process. The two strategies alternate for
``--rounds`` rounds so that neither profits from a quieter moment of the machine; each reports the
median wall and CPU time of a step after warm-up, per round. ``--bucket-mb`` sets both strategies' gradient
bucket size (DDP's ``bucket_cap_mb``, FourD's ``bucket_mb``) and ``--layers`` the example GPT's blocks:
``--layers 8 --bucket-mb 0.05`` cuts its 6.6 MB of gradients (69 parameters) into 69 buckets, about the count a
1B-parameter model has at the default 25 MB. FourD's bucket count is reported.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CpuStepTimer, accelerator, command, quiet_trainer, random_tokens,  # noqa: E402
                          write)
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 8, 128


def run(strategy, steps: int, accelerator: str) -> tuple[float, float, int, list[int]]:
    pl.seed_everything(0, verbose=False)
    model = GPT(**MODEL)
    data = DataLoader(random_tokens(BATCH * 2 * (steps + 1), SEQ, MODEL["vocab_size"]), batch_size=BATCH,
                      shuffle=True)
    timer, buckets = CpuStepTimer(), BucketCount()
    trainer = quiet_trainer(accelerator=accelerator, devices=2, strategy=strategy, max_steps=steps)
    trainer.callbacks += [timer, buckets]
    trainer.fit(model, data)
    return timer.median, statistics.median(timer.cpu), trainer.global_rank, buckets.counts


class BucketCount(pl.Callback):
    """FourD's gradient buckets per optimizer, read during training (the strategy lets go of them at teardown)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        parallel = getattr(trainer.strategy, "parallel", None)
        if parallel is not None:
            self.counts = parallel.gradient_bucket_counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=None, help="both strategies' bucket size (default: theirs)")
    parser.add_argument("--layers", type=int, default=MODEL["n_layer"], help="the example GPT's blocks")
    args = parser.parse_args()
    MODEL["n_layer"] = args.layers
    device = accelerator(2)
    names = ("Lightning DDPStrategy", "FourDStrategy(dp=2)")
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    rank, buckets = 0, []
    for _ in range(args.rounds):
        for name in names:
            if name.startswith("Lightning"):
                strategy = DDPStrategy() if args.bucket_mb is None else DDPStrategy(bucket_cap_mb=args.bucket_mb)
            else:
                strategy = FourDStrategy(dp=2) if args.bucket_mb is None else FourDStrategy(dp=2, bucket_mb=args.bucket_mb)
            median, cpu_median, rank, counted = run(strategy, args.steps, device)
            buckets = counted or buckets
            wall[name].append(median)
            cpu[name].append(cpu_median)
    if rank != 0:
        return
    tokens_per_step = 2 * BATCH * SEQ
    rows = {name: {"step_s": min(wall[name]), "tokens_per_s": tokens_per_step / min(wall[name]),
                   "step_s_rounds": wall[name], "cpu_s_rounds": cpu[name]} for name in names}
    ratio = rows["FourDStrategy(dp=2)"]["step_s"] / rows["Lightning DDPStrategy"]["step_s"]
    payload = {"command": command("dp.py"), "model": MODEL, "batch_per_rank": BATCH, "seq_len": SEQ,
               "accelerator": device, "bucket_mb": args.bucket_mb, "fourd_gradient_buckets": buckets,
               "results": rows, "fourd_over_ddp_step_time": ratio,
               "fourd_over_ddp_cpu_time": min(cpu["FourDStrategy(dp=2)"]) / min(cpu["Lightning DDPStrategy"])}
    name = "dp" if args.bucket_mb is None else "dp_buckets"
    print(table("dp", payload), f"\n(written to {write(name, payload)})")


if __name__ == "__main__":
    main()
