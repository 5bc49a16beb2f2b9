"""Tiny modules and data sets for the parity tests; they know nothing about lightning_4d."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset


class Classifier(pl.LightningModule):
    """An MLP with a torchmetrics accuracy, an LR scheduler and an unused parameter, logged as DDP users do."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, classes))
        self.unused = nn.Linear(2, 2)  # never called: its gradient stays None, as in one process
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, on_epoch=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def classification_data(train: bool = True, size: int = 64, features: int = 16, classes: int = 4):
    generator = torch.Generator().manual_seed(0 if train else 1)
    x = torch.randn(size, features, generator=generator)
    y = (x[:, :classes].argmax(dim=1) + (x[:, -1] > 1).long()) % classes
    return TensorDataset(x, y)


class ImageClassifier(Classifier):
    """The classifier on one-channel 6 x 6 images: a convolution, then the MLP (a batch's dim 1 is its channels)."""

    def __init__(self, lr: float = 0.05):
        super().__init__(features=4 * 4 * 4, lr=lr)
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), self.net)


def image_data(train: bool = True, size: int = 64, classes: int = 4):
    generator = torch.Generator().manual_seed(0 if train else 1)
    x = torch.randn(size, 1, 6, 6, generator=generator)
    return TensorDataset(x, x.flatten(1)[:, :classes].argmax(dim=1))
