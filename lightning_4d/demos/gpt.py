"""A small, plain GPT written the way everyday model code is written.

It deliberately knows nothing about any parallelism: the point of the example
is that a strategy, not the model author, takes care of splitting it up.
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


def rotary_tables(block_size: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Precompute rotary cos/sin tables of shape [block_size, head_dim] (halves repeated)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape [B, T, H, D] by per-position angles given as [T, D] tables."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions and separate q, k, v, o projections."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.q_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.o_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim)
        q = apply_rotary(q, cos, sin).transpose(1, 2)
        k = apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """The feed-forward block: up-projection, GELU, down-projection."""

    def __init__(self, n_embd: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.up_proj = nn.Linear(n_embd, mlp_ratio * n_embd, bias=False)
        self.act = nn.GELU()
        self.down_proj = nn.Linear(mlp_ratio * n_embd, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(self.act(self.up_proj(x))))


class Block(nn.Module):
    """A pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, n_embd: int, n_head: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp_norm = nn.RMSNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd, mlp_ratio, dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPTModel(nn.Module):
    """Token embedding, the blocks, a final norm and the language-model head (optionally tied)."""

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 8,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.ModuleList(Block(n_embd, n_head, mlp_ratio, dropout) for _ in range(n_layer))
        self.norm = nn.RMSNorm(n_embd, eps=1e-5)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rotary_tables(block_size, n_embd // n_head)
        # Not persistent: derived from hyperparameters, so checkpoints need not carry them.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.cos.size(0):
            raise ValueError(f"sequence length {T} exceeds block_size {self.cos.size(0)}")
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class GPT(L.LightningModule):
    """Next-token language model; batches are ``(input_ids, labels)`` LongTensors of shape [B, T]."""

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 8,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPTModel(vocab_size, n_layer, n_head, n_embd, block_size, mlp_ratio, dropout, tie_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch) -> torch.Tensor:
        input_ids, labels = batch
        logits = self(input_ids)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Greedy next-token prediction: the argmax byte after each sequence, shape [B]."""
        input_ids, _ = batch
        return self(input_ids)[:, -1].argmax(dim=-1)

    def configure_optimizers(self):
        # Norm gains (1-D) are not decayed, as is usual for transformers.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        if self.hparams.warmup_steps <= 0:
            return optimizer
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
