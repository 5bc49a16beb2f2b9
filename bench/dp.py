"""FourDStrategy(dp=2) against Lightning's DDPStrategy: same model, same batches, two processes.

    OMP_NUM_THREADS=1 python bench/dp.py [--steps 30] [--rounds 2]

Lightning's launcher re-runs this script in the second process. The two strategies alternate for
``--rounds`` rounds so that neither profits from a quieter moment of the machine; each reports the
median step time after warm-up.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (StepTimer, accelerator, command, quiet_trainer, random_tokens,  # noqa: E402
                          rounds_args, write)
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 8, 128


def run(strategy, steps: int, accelerator: str) -> tuple[float, float]:
    pl.seed_everything(0, verbose=False)
    model = GPT(**MODEL)
    data = DataLoader(random_tokens(BATCH * 2 * (steps + 1), SEQ, MODEL["vocab_size"]), batch_size=BATCH,
                      shuffle=True)
    timer = StepTimer()
    trainer = quiet_trainer(accelerator=accelerator, devices=2, strategy=strategy, max_steps=steps)
    trainer.callbacks.append(timer)
    trainer.fit(model, data)
    return timer.median, trainer.global_rank


def main() -> None:
    args = rounds_args()
    device = accelerator(2)
    times = {"Lightning DDPStrategy": [], "FourDStrategy(dp=2)": []}
    rank = 0
    for _ in range(args.rounds):
        for name in times:
            strategy = DDPStrategy() if name.startswith("Lightning") else FourDStrategy(dp=2)
            median, rank = run(strategy, args.steps, device)
            times[name].append(median)
    if rank != 0:
        return
    tokens_per_step = 2 * BATCH * SEQ
    rows = {name: {"step_s": min(t), "tokens_per_s": tokens_per_step / min(t)} for name, t in times.items()}
    ratio = rows["FourDStrategy(dp=2)"]["step_s"] / rows["Lightning DDPStrategy"]["step_s"]
    payload = {"command": command("dp.py"), "model": MODEL, "batch_per_rank": BATCH, "seq_len": SEQ,
               "accelerator": device, "results": rows, "fourd_over_ddp_step_time": ratio}
    print(table("dp", payload), f"\n(written to {write('dp', payload)})")


if __name__ == "__main__":
    main()
