"""Language models for the parity tests, written as users write them; none knows about lightning_4d.

- ``tiny_gpt``: the example GPT (separate q/k/v/o, RMSNorm, rotary tables sliced ``[:T]``) at test size.
- ``NanoGPT``: nanoGPT style: fused ``c_attn``, ``view(B, T, n_head, C // n_head)``, learned positions from
  ``torch.arange(T)``, weights tied between ``wte`` and ``lm_head``.
- ``head_trained_tied_gpt``: the example GPT, its embedding tied to the head and looked up detached.
- ``HFCausalLM``: a Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` from a tiny config (random
  weights, no download) inside a plain LightningModule.
- ``token_data``: a random token data set of ``(input_ids, labels)`` windows for the harness.

They train with SGD (momentum 0.9). AdamW's first steps scale every gradient element to about +-lr, so a
1e-9 round-off difference in a near-zero gradient element (a key bias, whose true gradient is zero) becomes
a weight difference of up to 2*lr between two correct runs; with SGD a weight difference stays proportional
to the gradient difference, and a 1e-5 bound on weights means something. AdamW parity is covered by the data
parallel tests, on a model without such elements.
"""

import math
from contextlib import nullcontext

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from lightning_4d.demos.gpt import GPT

VOCAB = 64
SEQ = 16


def token_data(train: bool = True, size: int = 32, seq_len: int = SEQ, vocab: int = VOCAB):
    generator = torch.Generator().manual_seed(0 if train else 1)
    tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class _CausalLM(pl.LightningModule):
    """Cross-entropy next-token training, logged the way DDP users log."""

    def _loss(self, batch):
        input_ids, labels = batch
        logits = self(input_ids)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return sgd(self)


def sgd(module: nn.Module, lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)


class TinyGPT(GPT):
    def configure_optimizers(self):
        return sgd(self)


TINY_GPT = dict(vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=32, block_size=64)  # the tests' GPT size


def tiny_gpt(**overrides) -> GPT:
    return TinyGPT(**{**TINY_GPT, **overrides})


class _DrawingGPT(TinyGPT):
    def training_step(self, batch, batch_idx):
        torch.rand(())  # as dropout would draw; the loss does not depend on it
        return super().training_step(batch, batch_idx)


def drawing_gpt(**overrides) -> GPT:
    """The tests' GPT whose training step also draws from torch's random stream: a step run before training (a
    layout trial's) shows in the stream's state unless the state is put back."""
    return _DrawingGPT(**{**TINY_GPT, **overrides})


class _DetachedEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight.detach())


def head_trained_tied_gpt(**overrides) -> GPT:
    """The example GPT with its embedding tied to the head but looked up detached: the shared weight learns from
    the head alone (under pipeline parallelism the first stage forms no gradient for it, the last stage does)."""
    module = tiny_gpt(tie_weights=True, **overrides)
    model = module.model
    model.tok_emb = _DetachedEmbedding(*model.tok_emb.weight.shape)
    model.tok_emb.weight = model.lm_head.weight
    return module


class NanoGPTAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class NanoGPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = NanoGPTAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(_CausalLM):
    def __init__(self, vocab_size: int = VOCAB, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 32):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([NanoGPTBlock(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class HFCausalLM(_CausalLM):
    def __init__(self, kind: str = "llama", vocab_size: int = VOCAB, hidden: int = 32, layers: int = 4,
                 heads: int = 4, kv_heads: int = 2):
        super().__init__()
        import transformers

        if kind == "llama":
            config = transformers.LlamaConfig(
                vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=None)
            self.model = transformers.LlamaForCausalLM(config)
        elif kind == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                bos_token_id=0, eos_token_id=1)
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            raise ValueError(f"kind={kind!r}: use 'llama' or 'gpt2'")

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def gradient_norm(module: nn.Module) -> torch.Tensor:
    """The 2-norm of all gradients, as a user writes it for tensor-parallel or sharded (DTensor) gradients:
    Lightning's ``grad_norm`` cannot stack DTensor norms."""
    norms = [torch.linalg.vector_norm(p.grad) for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))


class ManualGPT(TinyGPT):
    """Manual optimization as Lightning's docs write it: ``manual_backward``, a logged gradient norm
    (:func:`gradient_norm`), norm clipping at ``clip`` and a step every ``accumulate`` batches, each batch split
    into ``chunks`` that each run forward and ``manual_backward``; every backward but the one before the step
    inside the strategy's ``block_backward_sync()`` (in one process: no strategy, nothing to block).
    ``block_last``: the backward before the step too (a mistake the strategy must refuse)."""

    def __init__(self, clip: float = 0.5, accumulate: int = 1, chunks: int = 1, block_last: bool = False,
                 **config):
        super().__init__(**config)
        self.clip, self.accumulate, self.chunks, self.block_last = clip, accumulate, chunks, block_last
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        stepping = (batch_idx + 1) % self.accumulate == 0
        block = getattr(self.trainer.strategy, "block_backward_sync", nullcontext)
        losses = []
        for index, chunk in enumerate(zip(*(part.chunk(self.chunks) for part in batch))):
            losses.append(self._loss(chunk))
            last = stepping and index == self.chunks - 1
            with block() if self.block_last or not last else nullcontext():
                self.manual_backward(losses[-1] / (self.accumulate * self.chunks))
        loss = torch.stack(losses).mean()
        self.log("train_loss", loss, sync_dist=True)
        if stepping:
            self.log("grad_norm", gradient_norm(self))
            self.clip_gradients(optimizer, self.clip, "norm")
            optimizer.step()
            optimizer.zero_grad()
        return loss


def manual_gpt(**options) -> ManualGPT:
    return ManualGPT(**options, **TINY_GPT)


def pretrained_llama(path: str, **config) -> HFCausalLM:
    """``HFCausalLM(kind="llama")`` with the weights of the Hugging Face directory ``path``, loaded by transformers'
    own ``from_pretrained``: the single-process side of a case that starts from ``path`` through
    ``FourDStrategy(init_from=...)``."""
    import transformers

    module = HFCausalLM(kind="llama", **config)
    module.model.load_state_dict(transformers.LlamaForCausalLM.from_pretrained(path).state_dict())
    return module


def torch_file_of(checkpoint_dir: str, path: str) -> str:
    """The lightning-4d checkpoint directory ``checkpoint_dir`` as one ``torch.save`` file at ``path``, written by
    torch's own converter (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``), not by ours."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_dir, path)
    return path


def loaded_module(build: str, path: str, **kwargs) -> pl.LightningModule:
    """The module ``build`` (``"package.module:factory"``) makes from ``kwargs``, with the ``state_dict`` of the
    checkpoint file ``path`` loaded by ``torch.load`` and ``load_state_dict``, as a user of one plain process loads
    one: the single-process side of a case that starts from a checkpoint through ``FourDStrategy(init_from=...)``."""
    from tests.parity import _load

    module = _load(build)(**kwargs)
    module.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    return module
