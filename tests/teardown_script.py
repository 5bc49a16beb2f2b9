"""Run by tests/test_teardown.py many times, as a new user runs a script: Lightning's own launcher starts the
second rank. A short fit at dp=2, then one last collective right before the interpreter exits. A gloo worker
thread that finishes a collective that late still has to hand its tensors back to Python; before
:func:`lightning_4d.faults.report._release_collective_threads` it sometimes asked for the GIL after finalization
had begun and aborted the process ("terminate called without an active exception"): 12 launches in 40 on torch
2.15.0 on a 2-core machine."""

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from tests.lm_models import TinyGPT, token_data

if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(dp=2), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyGPT(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=32),
                DataLoader(token_data(size=8, seq_len=32), batch_size=4))
    ranks = trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")
    print(f"finished rank {trainer.global_rank} of {ranks.int()}", file=sys.stderr, flush=True)
