"""One device, one process: FourDStrategy() against Lightning's own strategy (``auto``: SingleDeviceStrategy) on
the example GPT, step time and peak device memory. What a machine with a single GPU can measure of the strategy's
own cost (every multi-rank benchmark needs as many GPUs as ranks for its NCCL pass).

    python bench/single_device.py fourd gpu 60      # strategy, accelerator, steps
    python bench/single_device.py auto gpu 60

Prints one ``RESULT {json}`` line: median, mean and min step time over the steps after the first five (CUDA
synchronized around each step), the whole fit, ``torch.cuda.max_memory_allocated`` and the last train loss.
"""

import json
import sys
import time

import lightning.pytorch as pl
import torch

from lightning_4d import FourDStrategy
from lightning_4d.demos.data import TextDataModule
from lightning_4d.demos.gpt import GPT


class StepTimes(pl.Callback):
    def __init__(self, accelerator: str) -> None:
        self.accelerator, self.times, self.start = accelerator, [], 0.0

    def _sync(self) -> None:
        if self.accelerator == "gpu":
            torch.cuda.synchronize()

    def on_train_batch_start(self, *args) -> None:
        self._sync()
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self.start)


def main(strategy: str, accelerator: str, steps: int) -> dict:
    torch.manual_seed(0)
    timer = StepTimes(accelerator)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=FourDStrategy() if strategy == "fourd" else "auto",
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[timer], limit_val_batches=0, num_sanity_val_steps=0)
    if accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    wall = time.perf_counter()
    trainer.fit(GPT(n_layer=4, n_embd=256, block_size=256), datamodule=TextDataModule(seq_len=256, max_bytes=2_000_000))
    wall = time.perf_counter() - wall
    kept = sorted(timer.times[5:])
    return dict(strategy=strategy, steps=len(timer.times), median_ms=1e3 * kept[len(kept) // 2],
                mean_ms=1e3 * sum(kept) / len(kept), min_ms=1e3 * kept[0], first_ms=1e3 * timer.times[0], fit_s=wall,
                max_mem_MiB=torch.cuda.max_memory_allocated() / 2**20 if accelerator == "gpu" else 0.0,
                loss=float(trainer.callback_metrics.get("train_loss", float("nan"))),
                strategy_type=type(trainer.strategy).__name__)


if __name__ == "__main__":
    print("RESULT", json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
