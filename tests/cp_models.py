"""Modules and data for the context-parallel tests; like ``lm_models`` they know nothing about lightning_4d.

Each variant of ``NanoGPT`` changes one thing context parallelism must handle (or refuse): how attention is
computed or masked, where positions come from.
"""

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.lm_models import SEQ, VOCAB, HFCausalLM, NanoGPT, NanoGPTAttention, token_data


def _heads(attn: NanoGPTAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    B, T, C = x.size()
    q, k, v = attn.c_attn(x).split(attn.n_embd, dim=2)
    return tuple(t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v))


def _merge_heads(attn: NanoGPTAttention, y: torch.Tensor) -> torch.Tensor:
    B, _, T, _ = y.shape
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def build_mask(kind: str, T: int, device: torch.device) -> torch.Tensor:
    """Masks as model code builds them from the length it sees."""
    i = torch.arange(T, device=device)
    causal = i[:, None] >= i[None, :]
    if kind == "causal_bool":
        return causal
    if kind == "causal_float":  # Hugging Face's additive form
        return torch.zeros(T, T, device=device).masked_fill(~causal, torch.finfo(torch.float32).min)
    if kind == "window":  # sliding window of 4 tokens
        return causal & (i[:, None] - i[None, :] < 4)
    if kind == "documents":  # documents of 4 tokens packed into one sequence
        return causal & (i[:, None] // 4 == i[None, :] // 4)
    raise ValueError(f"unknown mask kind {kind!r}")


class MaskedAttention(NanoGPTAttention):
    """Attention through an explicit ``attn_mask`` instead of ``is_causal``."""

    def __init__(self, n_embd: int, n_head: int, mask: str):
        super().__init__(n_embd, n_head)
        self.mask = mask

    def forward(self, x):
        q, k, v = _heads(self, x)
        return _merge_heads(self, F.scaled_dot_product_attention(q, k, v, attn_mask=build_mask(self.mask, x.size(1),
                                                                                                x.device)))


class SoftmaxAttention(NanoGPTAttention):
    """Hand-written causal softmax attention: no scaled_dot_product_attention call to intercept."""

    def forward(self, x):
        q, k, v = _heads(self, x)
        T = x.size(1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~build_mask("causal_bool", T, x.device), float("-inf"))
        return _merge_heads(self, scores.softmax(-1) @ v)


class AttentionVariantGPT(NanoGPT):
    """NanoGPT with ``attention="softmax"`` or an explicit mask kind (see :func:`build_mask`)."""

    def __init__(self, attention: str = "causal_bool", n_embd: int = 32, n_head: int = 4, **kwargs):
        super().__init__(n_embd=n_embd, n_head=n_head, **kwargs)
        for block in self.transformer.h:
            block.attn = (SoftmaxAttention(n_embd, n_head) if attention == "softmax"
                          else MaskedAttention(n_embd, n_head, attention))


class BatchPositionsGPT(NanoGPT):
    """Takes its position ids from the batch, as packed-data pipelines provide them."""

    def forward(self, idx, pos):
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def _loss(self, batch):
        input_ids, labels, positions = batch
        logits = self(input_ids, positions)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def token_data_with_positions(train: bool = True):
    inputs, labels = token_data(train).tensors
    return TensorDataset(inputs, labels, torch.arange(SEQ).expand_as(inputs).clone())


def odd_length_data(train: bool = True):
    return token_data(train, seq_len=30)


def window_length_data(train: bool = True):
    """Sequences of SlidingWindowMistral's window (12 tokens), which then masks nothing."""
    return token_data(train, seq_len=12)


class PaddedLlama(HFCausalLM):
    """Hugging Face Llama given a padding mask: the first three tokens of every sequence are padding."""

    def _loss(self, batch):
        input_ids, labels = batch
        attention_mask = torch.ones_like(input_ids)
        attention_mask[:, :3] = 0
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class LabelsLM(HFCausalLM):
    """A Hugging Face causal LM computing its own loss from ``labels=``, which it shifts by one token itself, as
    most Hugging Face fine-tuning code does: ``gpt2`` and ``llama`` as tests.lm_models builds them, any other
    family as the zoo does."""

    def __init__(self, family: str = "llama"):
        if family in ("gpt2", "llama"):
            super().__init__(family)
        else:
            from tests.zoo_models import HFZooLM

            pl.LightningModule.__init__(self)
            self.model = HFZooLM(family).model

    def _loss(self, batch):
        input_ids, _ = batch
        return self.model(input_ids=input_ids, labels=self.labels(input_ids)).loss

    def labels(self, input_ids):
        return input_ids


class BuiltLabelsLM(LabelsLM):
    """Labels made in the step (a copy): not the batch's tensor, so their neighbors on other cp ranks are unknown."""

    def labels(self, input_ids):
        return input_ids.clone()


class CheckpointedLlama(HFCausalLM):
    """Hugging Face Llama with activation checkpointing: attention runs again during backward."""

    def __init__(self, use_reentrant: bool = False):
        super().__init__()
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


class SlidingWindowMistral(pl.LightningModule):
    """Hugging Face Mistral with a 12-token sliding window: its local mask looks causal on an 8-token shard."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, sliding_window=12, attn_implementation="sdpa")
        self.model = transformers.MistralForCausalLM(config)

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        logits = self.model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PredictProbe(pl.Callback):
    """After fit, predicts four validation sequences and records a plain forward of the same weights beside it."""

    def parity_extras(self, trainer):
        input_ids, labels = (t[:4] for t in token_data(train=False).tensors)
        module = trainer.lightning_module
        predicted = trainer.predict(module, DataLoader(TensorDataset(input_ids, labels), batch_size=4))[0]
        with torch.no_grad():
            direct = module(input_ids)[:, -1].argmax(dim=-1)
        return {"predicted": predicted, "direct": direct}
