"""Hugging Face models and batches with the masks long-context training uses, for tests/test_cp_masks.py; like
``lm_models`` they know nothing about lightning_4d.

Batches are dicts, as Hugging Face collators give them: ``input_ids``, ``labels`` (already shifted by one, -100
where nothing is predicted) and, per kind, ``attention_mask`` (right padding of unequal lengths) or
``position_ids`` that restart at 0 for each packed document (Hugging Face then masks across documents).
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from tests.lm_models import VOCAB

SEQ = 32  # 4x the window of the sliding-window models
WINDOW = 8


def _config(family: str, unmasked: bool = False):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "llama8":  # 8 query and 4 key/value heads: cp=4 divides both (Ulysses)
        return transformers.LlamaConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 4})
    if family == "mistral":  # one window for every layer (unmasked: none)
        return transformers.MistralConfig(**common, sliding_window=None if unmasked else WINDOW)
    if family == "gemma3":  # a sliding-window layer, then a global one (unmasked: two global ones)
        return transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=WINDOW,
                                             layer_types=["full_attention" if unmasked else "sliding_attention",
                                                          "full_attention"])
    raise ValueError(f"unknown family {family!r}")


class MaskedLM(pl.LightningModule):
    """A Hugging Face causal LM given the batch's ``attention_mask`` and ``position_ids`` as they come;
    ``unmasked``: without padding, document and sliding-window masks (the positions stay), to show what the
    masks change."""

    def __init__(self, family: str = "llama", unmasked: bool = False):
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_config(_config(family, unmasked))
        self.unmasked = unmasked

    def training_step(self, batch, batch_idx):
        # Hugging Face detects packed documents only without a cache (past_key_values): a training step has none.
        # Unmasked: no padding mask, and the cache turns the detection off (the positions stay).
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                            attention_mask=None if self.unmasked else batch.get("attention_mask"),
                            use_cache=self.unmasked).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tokens(train: bool, size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + (0 if train else 1))
    return torch.randint(0, VOCAB, (size, SEQ + 1), generator=generator)


def plain_data(train: bool = True, size: int = 32):
    """Whole sequences of 4 windows."""
    tokens = _tokens(train, size, 30)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def padded_data(train: bool = True, size: int = 32):
    """Padded samples of 8 to 32 tokens: every other one padded on the right (as SFT collators do), the others
    on the left (as for generation), where the padding precedes what the tokens attend to."""
    tokens = _tokens(train, size, 40)
    lengths = torch.randint(8, SEQ + 1, (size,), generator=torch.Generator().manual_seed(41))
    samples = []
    for index, (t, length) in enumerate(zip(tokens, lengths)):
        order = torch.arange(SEQ)
        valid = order < length if index % 2 else order >= SEQ - length
        last = order == (length - 1 if index % 2 else SEQ - 1)  # predicts nothing
        samples.append({"input_ids": t[:-1].masked_fill(~valid, 0), "attention_mask": valid.long(),
                        "labels": t[1:].masked_fill(~valid | last, -100)})
    return samples


def packed_data(train: bool = True, size: int = 32):
    """Documents of unequal lengths (2 to 12 tokens) packed into each row, positions restarting at 0 for each;
    the last token of a document predicts nothing."""
    tokens = _tokens(train, size, 50)
    generator = torch.Generator().manual_seed(51)
    samples = []
    for t in tokens:
        positions, ends = [], []
        while len(positions) < SEQ:
            length = min(int(torch.randint(2, 13, (1,), generator=generator)), SEQ - len(positions))
            positions += list(range(length))
            ends.append(len(positions) - 1)
        labels = t[1:].clone()
        labels[ends] = -100
        samples.append({"input_ids": t[:-1], "position_ids": torch.tensor(positions), "labels": labels})
    return samples


class DocumentAttentionLM(pl.LightningModule):
    """A hand-written causal LM that masks attention across documents itself, from a ``document_ids`` batch entry
    (no ``position_ids``): what ``cp_document_key`` names under context parallelism."""

    def __init__(self, width: int = 32, heads: int = 4, unmasked: bool = False):
        super().__init__()
        self.heads, self.unmasked = heads, unmasked
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.wpe = torch.nn.Embedding(SEQ, width)  # GPT-2's name: context parallelism gives it global positions
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, document_ids):
        length = input_ids.size(1)
        x = self.embed(input_ids) + self.wpe(torch.arange(length, device=input_ids.device))
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        order = torch.arange(length, device=input_ids.device)
        mask = (order[:, None] >= order[None, :]) & (document_ids[:, :, None] == document_ids[:, None, :])
        if self.unmasked:
            mask = (order[:, None] >= order[None, :]).expand_as(mask)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.head(x + self.out(y.transpose(1, 2).flatten(2)))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["document_ids"])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def document_data(train: bool = True, size: int = 32):
    """:func:`packed_data` with a document id per token in place of restarting positions."""
    samples = []
    for sample in packed_data(train, size):
        documents = (sample.pop("position_ids") == 0).long().cumsum(0)
        samples.append({**sample, "document_ids": documents})
    return samples


class PaddingBlindLM(DocumentAttentionLM):
    """:class:`DocumentAttentionLM`'s layer with causal order alone as its mask: a model that leaves the batch's
    ``attention_mask`` unused (it attends to padding keys, in one process too)."""

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], torch.zeros_like(batch["input_ids"]))  # one document per row
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss


def late_padded_data(train: bool = True, size: int = 32, attention_mask: bool = True):
    """The 4 samples of the parity harness's first batch whole (its sampler: a DistributedSampler shuffling
    with seed 1234, the Case default), the others right-padded after 4 to 8 tokens (every shard of a cp=2 split
    holds padding keys); ``attention_mask``: whether the samples carry one."""
    tokens = _tokens(train, size, 60)
    lengths = torch.randint(4, 9, (size,), generator=torch.Generator().manual_seed(61))
    first = set(torch.randperm(size, generator=torch.Generator().manual_seed(1234))[:4].tolist())
    samples = []
    for index, (t, length) in enumerate(zip(tokens, lengths)):
        valid = torch.arange(SEQ) < (SEQ if index in first else length)
        sample = {"input_ids": t[:-1], "labels": t[1:].masked_fill(~valid, -100)}
        samples.append({**sample, "attention_mask": valid.long()} if attention_mask else sample)
    return samples


def late_padded_data_without_mask(train: bool = True, size: int = 32):
    """:func:`late_padded_data` without ``attention_mask``."""
    return late_padded_data(train, size, attention_mask=False)
