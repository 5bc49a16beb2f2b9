"""``python -m tests.save_after_fit_script DIR``: one process fits a step with ``FourDStrategy(async_save=True)``,
then saves with ``trainer.save_checkpoint`` while each background write is slowed by 2 s, and ends at once: the
checkpoint must be complete when the process has exited (tests/test_async_checkpoint.py)."""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from lightning_4d.checkpoint import sharded
from tests.models import Classifier, classification_data

if __name__ == "__main__":
    directory = Path(sys.argv[1])
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(async_save=True), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Classifier(), DataLoader(classification_data(), batch_size=8))
    write = sharded.write

    def slow(*args, **kwargs):
        time.sleep(2)
        return write(*args, **kwargs)

    sharded.write = slow
    trainer.save_checkpoint(directory / "final.ckpt")
    print(f"save_checkpoint returned; complete yet: {(directory / 'final.ckpt').exists()}", flush=True)
