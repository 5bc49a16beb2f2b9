"""Run by tests/test_lightning_features.py in two processes (Lightning's own launcher starts the second).

The Lightning features a DDP user relies on, under FourDStrategy(dp=2): EarlyStopping and ModelCheckpoint
monitoring a synced metric, validate/test/predict loops, self.all_gather, strategy.broadcast/barrier/reduce.
"""

import json
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from tests.models import Classifier, classification_data


class Features(Classifier):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).argmax(-1)

    def on_validation_epoch_end(self):
        gathered = self.all_gather(torch.tensor([float(self.global_rank)]))
        self.gathered_shape = list(gathered.shape)


def main(out: str) -> None:
    pl.seed_everything(0)
    model = Features()
    early = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # stops after the second validation
    best = ModelCheckpoint(dirpath=f"{out}/ckpt", monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(dp=2), max_epochs=10,
                         val_check_interval=1.0, limit_val_batches=2, logger=False, enable_progress_bar=False,
                         callbacks=[early, best])
    train = DataLoader(classification_data(), batch_size=8, shuffle=True)
    val = DataLoader(classification_data(train=False), batch_size=8)
    trainer.fit(model, train, val)
    test = trainer.test(model, val, verbose=False)
    predictions = trainer.predict(model, DataLoader(classification_data(train=False), batch_size=8))
    strategy = trainer.strategy
    shared = strategy.broadcast(f"from rank {trainer.global_rank}")
    strategy.barrier("done")
    summed = strategy.reduce(torch.tensor(1.0), reduce_op="sum")
    if trainer.global_rank == 0:
        json.dump({"epochs": trainer.current_epoch, "stopped": early.stopped_epoch, "best": best.best_model_path,
                   "test": test, "predictions": sum(len(p) for p in predictions),
                   "gathered_shape": model.gathered_shape, "broadcast": shared, "reduced": float(summed)},
                  open(f"{out}/result.json", "w"))


if __name__ == "__main__":
    main(sys.argv[1])
