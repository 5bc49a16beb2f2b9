"""Training steps that depend on where a token sits or on the length they see, written the way users write them,
on a tiny Hugging Face Llama (``tests.lm_models.HFCausalLM``); and the same steps rewritten with
``lightning_4d.sequence_positions`` or with what they need built in the data. None knows about lightning_4d but
for that helper.

``StepPatternLlama(pattern=...)`` picks the step; ``token_data`` batches are ``(input_ids, labels)`` windows
already shifted, ``single_token_data`` one tensor per sample (the step shifts it), ``lengths_data`` adds each
sample's length (for a padding mask built in the step), ``prompt_masked_data`` has the prompt masked in the
labels (-100), as a data pipeline writes it.
"""

import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import TensorDataset

from lightning_4d import sequence_positions
from tests.lm_models import SEQ, VOCAB, HFCausalLM, token_data

LAST = 4  # the "response" tokens a last-n loss keeps
PROMPT = 6  # prompt tokens masked out of the loss
# Patterns whose unchanged step computes another value on a shard (refused by the check), and those the check
# passes (a count it learns to combine, a helper or data rewrite, a metric logged per epoch). "random_scale" draws
# a random number each step: checked and unchecked runs must be the same to the bit.
SILENT = ("last_n", "position_weighted", "prompt_mask", "mlm_mask", "logits_shift")
FAILING_ON_SHARD = ("one_tensor_shift", "packed_positions", "padding_in_step")
PER_STEP_METRIC = "metric_per_step"
AT_PARITY = ("counts", "last_n_helper", "position_weighted_helper", "prompt_mask_helper", "mlm_mask_helper",
             "prompt_mask_in_data", "metric_per_epoch")


class StepPatternLlama(HFCausalLM):
    def __init__(self, pattern: str = "last_n"):
        super().__init__(kind="llama", layers=2)
        self.pattern = pattern
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)
        self.train_perplexity = torchmetrics.text.Perplexity()

    def training_step(self, batch, batch_idx):
        loss = getattr(self, f"_{self.pattern}")(batch)
        self.log("train_loss", loss)
        return loss

    # ------------------------------------------------------------- written as users write them (differ under cp)

    def _last_n(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits[:, -LAST:].reshape(-1, VOCAB), y[:, -LAST:].reshape(-1))

    def _position_weighted(self, batch):
        x, y = batch
        T = x.size(1)
        w = (1 + torch.arange(T, device=x.device)) / T
        losses = F.cross_entropy(self(x).transpose(1, 2), y, reduction="none")
        return (losses * w).mean()

    def _prompt_mask(self, batch):
        x, y = batch
        labels = y.masked_fill(torch.arange(x.size(1), device=x.device) < PROMPT, -100)
        return F.cross_entropy(self(x).reshape(-1, VOCAB), labels.reshape(-1))

    def _mlm_mask(self, batch):
        x, y = batch
        chosen = (x + torch.arange(x.size(1), device=x.device)) % 3 == 0  # from ids and positions
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.masked_fill(~chosen, -100).reshape(-1))

    def _logits_shift(self, batch):
        (tokens,) = batch
        logits = self(tokens)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def _one_tensor_shift(self, batch):  # Lightning's tensor-parallel example
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def _packed_positions(self, batch):
        x, y = batch
        # documents separated by token 0; positions restart after each separator, computed from the tokens
        starts = (x == 0).long().cumsum(1)
        index = torch.arange(x.size(1), device=x.device).expand_as(x)
        first = torch.zeros_like(x).scatter_reduce(1, starts, index, reduce="amin", include_self=False)
        positions = index - first.gather(1, starts)
        logits = self.model(input_ids=x, position_ids=positions, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def _padding_in_step(self, batch):
        x, y, lengths = batch
        mask = (torch.arange(x.size(1), device=x.device) < lengths[:, None]).long()
        logits = self.model(input_ids=x, attention_mask=mask).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.masked_fill(mask == 0, -100).reshape(-1))

    def _metric_per_step(self, batch):
        x, y = batch
        logits = self(x)
        self.train_acc(logits.argmax(-1).reshape(-1), y.reshape(-1))
        self.train_perplexity(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_perplexity", self.train_perplexity, on_step=True, on_epoch=True)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    # -------------------------------------------------------------------------------- the same under any cp

    def _counts(self, batch):
        x, y = batch
        self.log("samples", x.size(0), reduce_fx="sum")  # whole on every shard: taken once
        self.log("tokens", (y != -100).sum().float(), reduce_fx="sum")  # the shards' sum
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def _last_n_helper(self, batch):
        x, y = batch
        positions, length = sequence_positions(y)
        labels = y.masked_fill(positions < length - LAST, -100)
        return F.cross_entropy(self(x).reshape(-1, VOCAB), labels.reshape(-1))

    def _position_weighted_helper(self, batch):
        x, y = batch
        positions, length = sequence_positions(x)
        w = (1 + positions) / length
        losses = F.cross_entropy(self(x).transpose(1, 2), y, reduction="none")
        return (losses * w).mean()

    def _prompt_mask_helper(self, batch):
        x, y = batch
        positions, _ = sequence_positions(x)
        labels = y.masked_fill(positions < PROMPT, -100)
        return F.cross_entropy(self(x).reshape(-1, VOCAB), labels.reshape(-1))

    def _mlm_mask_helper(self, batch):
        x, y = batch
        chosen = (x + sequence_positions(x).positions) % 3 == 0
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.masked_fill(~chosen, -100).reshape(-1))

    def _prompt_mask_in_data(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def _metric_per_epoch(self, batch):
        x, y = batch
        logits = self(x)
        self.train_acc(logits.argmax(-1).reshape(-1), y.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def _random_scale(self, batch):
        x, y = batch  # a scalar draw, the same whole and sharded: the check must leave the stream as it was
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)) * (1 + 0.1 * torch.rand(()))


def single_token_data(train: bool = True):
    """One token tensor per sample, as Lightning's tensor-parallel example loads it: the step shifts it."""
    inputs, labels = token_data(train).tensors
    return TensorDataset(torch.cat([inputs, labels[:, -1:]], 1)[:, :SEQ])


def lengths_data(train: bool = True):
    inputs, labels = token_data(train).tensors
    lengths = SEQ - torch.arange(inputs.size(0)) % 5
    return TensorDataset(inputs, labels, lengths)


def prompt_masked_data(train: bool = True):
    inputs, labels = token_data(train).tensors
    return TensorDataset(inputs, labels.clone().index_fill_(1, torch.arange(PROMPT), -100))


DATA = {"one_tensor_shift": "tests.cp_step_models:single_token_data",
        "logits_shift": "tests.cp_step_models:single_token_data",
        "padding_in_step": "tests.cp_step_models:lengths_data",
        "prompt_mask_in_data": "tests.cp_step_models:prompt_masked_data"}


# ------------------------------------------------- models whose forward computes something else on a shard
# The step check names the module that makes the difference (tests/test_cp_step_check.py).


class PoolerClassifier(HFCausalLM):
    """A BERT text classifier (``BertForSequenceClassification``): its pooler reads the first token."""

    def __init__(self):
        import lightning.pytorch as pl
        import transformers

        pl.LightningModule.__init__(self)
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         attn_implementation="sdpa")
        self.model = transformers.BertForSequenceClassification(config)

    def _loss(self, batch):
        input_ids, classes = batch
        return F.cross_entropy(self.model(input_ids=input_ids).logits, classes)


class PackedPoolerClassifier(PoolerClassifier):
    """The BERT classifier on rows that pack two documents (``position_ids`` restarting): under cp its batches are
    laid out by document, so the rank holding the first token is the layout's, not always rank 0."""

    def _loss(self, batch):
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return F.cross_entropy(logits, batch["labels"])


PACKED_DOCUMENTS = (12, 4)  # every row: a document of 12 tokens, then one of 4


def packed_positions() -> torch.Tensor:
    """The ``position_ids`` of every row of :func:`classified_packed_tokens`."""
    return torch.cat([torch.arange(length) for length in PACKED_DOCUMENTS])


def classified_packed_tokens(train: bool = True):
    """:func:`classified_tokens` as dicts, each row packing the documents of :data:`PACKED_DOCUMENTS`."""
    return [{"input_ids": inputs, "position_ids": packed_positions(), "labels": label}
            for inputs, label in classified_tokens(train)]


class LastTokenClassifier(PoolerClassifier):
    """A Llama classifier (``LlamaForSequenceClassification``): it reads the last token that is no padding."""

    def __init__(self):
        import lightning.pytorch as pl
        import transformers

        pl.LightningModule.__init__(self)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          num_labels=3, pad_token_id=VOCAB - 1, attn_implementation="sdpa")
        self.model = transformers.LlamaForSequenceClassification(config)


class PositionScale(torch.nn.Module):
    """Adds to each token a vector set by its place in the sequence, counted from the length it sees. (A scale
    alone would be normalized away by the next RMSNorm: on an untrained model it moved the first loss by 1e-5
    relative, inside the check's round-off bound, while the weights after two steps differed by 2e-3.)"""

    def forward(self, x):
        place = torch.arange(x.size(1), device=x.device, dtype=x.dtype)[:, None] / x.size(1)
        return x + place * torch.linspace(-1, 1, x.size(-1), device=x.device, dtype=x.dtype)


class PositionScaledLlama(HFCausalLM):
    """A Llama whose embeddings pass through :class:`PositionScale`, whose weights are built in its forward."""

    def __init__(self):
        super().__init__(kind="llama", layers=2)
        self.model.model.embed_tokens = torch.nn.Sequential(self.model.model.embed_tokens, PositionScale())


def classified_tokens(train: bool = True):
    """Token windows (no padding token) with one class each."""
    inputs, _ = token_data(train).tensors
    inputs = inputs.clamp(max=VOCAB - 2)
    return TensorDataset(inputs, inputs.sum(dim=1) % 3)
