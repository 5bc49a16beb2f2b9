"""A Vision Transformer written the way tutorials write it, on torch's ``nn.MultiheadAttention`` called with its
defaults: ``self.attn(x, x, x)[0]`` leaves ``need_weights=True``, so the weights are computed and thrown away.
``pool="attention"`` uses them: the class token's attention over the patches (averaged over the heads) pools the
last block's tokens for the head. Tiny: 8 x 8 images in 4 x 4 patches, 2 blocks of 4 heads; SGD."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tests.lm_models import sgd

DIM, HEADS, CLASSES = 32, 4, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1(x)
        out, weights = self.attn(h, h, h)
        x = x + out
        return x + self.mlp(self.norm2(x)), weights


class ViT(pl.LightningModule):
    def __init__(self, pool: str = "class_token") -> None:
        super().__init__()
        self.pool = pool
        self.patches = nn.Conv2d(3, DIM, kernel_size=4, stride=4)
        self.class_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.positions = nn.Parameter(torch.randn(1, 5, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.size(0), -1, -1), x], dim=1) + self.positions
        for block in self.blocks:
            x, weights = block(x)
        x = self.norm(x)
        if self.pool == "attention":  # the class token's attention over every token, averaged over the heads
            return self.head((weights[:, 0, :, None] * x).sum(dim=1))
        return self.head(x[:, 0])

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return sgd(self, lr=0.2)


def image_data(train: bool = True, size: int = 32):
    generator = torch.Generator().manual_seed(0 if train else 1)
    images = torch.randn(size, 3, 8, 8, generator=generator)
    return TensorDataset(images, images.mean(dim=(2, 3)).argmax(dim=1) + (images[:, 0, 0, 0] > 0).long())
