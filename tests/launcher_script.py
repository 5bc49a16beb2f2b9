"""A 2-rank run started with ``FourDStrategy(start_method="fork")`` whose rank 1 raises at step 2 (the first
argument ``ok`` makes it train normally). Run as a script by tests/test_launcher.py."""

import sys

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from tests.models import Classifier, classification_data


class FailsOnRankOne(Classifier):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            raise RuntimeError("boom on rank 1 at step 2")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    module = Classifier() if sys.argv[1] == "ok" else FailsOnRankOne()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(dp=2, start_method="fork"),
                         max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(classification_data(), batch_size=4))
    print(f"finished on global rank {trainer.global_rank} at step {trainer.global_step}", flush=True)
