"""Run by tests/test_teardown.py under tests.parity.launch, many times: a short fit at cp=2 (where an abort at
exit was seen), then a normal interpreter exit. A rank that aborts while tearing down fails the launch."""

import sys

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from tests.lm_models import TinyGPT, token_data

if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(cp=2), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyGPT(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=64),
                DataLoader(token_data(size=16), batch_size=4))
    print(f"finished rank {trainer.global_rank}", file=sys.stderr, flush=True)
