"""Fine-tuning batches as people build them, for the loss-normalization tests; nothing here knows lightning_4d.

- ``sft_data``: supervised fine-tuning windows whose prompt is masked with ``-100``: each sample's prompt length
  is drawn from 0 to the whole window, so samples, replicas, sequence shards and micro-batches hold very different
  numbers of answer tokens (some none at all).
- ``mlm_data``: BERT-style masked-LM targets: about 15% of the positions (at least one per sample) keep their
  token as the target, every other position is ``-100``.
- ``BertMLM``: a BERT-style encoder (bidirectional attention, ``BertForMaskedLM``) on those masked-LM targets.
- ``HFLabelsLM``: a Hugging Face Llama trained through its own loss (``labels=``; the labels are the next
  tokens already, passed as ``shift_labels`` too, as HF's own context-parallel recipe does).
- ``AuxLossLM``: the token-mean loss plus a small term of its own (a custom reduction the strategy cannot see
  through); ``WeightedLossLM``: ``nll_loss`` with class weights.
- ``ManualClipLM``: the zoo's Llama with manual optimization: ``manual_backward``, ``clip_gradients`` to a norm
  below the real one, ``step``.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from tests.lm_models import SEQ, VOCAB, HFCausalLM, _CausalLM, token_data


def sft_data(train: bool = True, size: int = 32, seq_len: int = SEQ, vocab: int = VOCAB):
    inputs, labels = token_data(train, size, seq_len, vocab).tensors
    generator = torch.Generator().manual_seed(10 if train else 11)
    prompt = torch.randint(0, seq_len + 1, (size, 1), generator=generator)
    labels = labels.masked_fill(torch.arange(seq_len) < prompt, -100)
    return TensorDataset(inputs, labels)


def mlm_data(train: bool = True, size: int = 32, seq_len: int = SEQ, vocab: int = VOCAB):
    inputs, _ = token_data(train, size, seq_len, vocab).tensors
    generator = torch.Generator().manual_seed(20 if train else 21)
    chosen = torch.rand(size, seq_len, generator=generator) < 0.15
    chosen[torch.arange(size), torch.randint(0, seq_len, (size,), generator=generator)] = True
    return TensorDataset(inputs, inputs.masked_fill(~chosen, -100))


class HFLabelsLM(HFCausalLM):
    def _loss(self, batch):
        input_ids, labels = batch
        return self.model(input_ids=input_ids, labels=labels, shift_labels=labels).loss


class AuxLossLM(HFCausalLM):
    def _loss(self, batch):
        input_ids, labels = batch
        logits = self(input_ids)
        token_mean = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return token_mean + 1e-3 * logits.float().pow(2).mean()


class WeightedLossLM(HFCausalLM):
    def _loss(self, batch):
        input_ids, labels = batch
        logits = self(input_ids)
        weight = torch.linspace(0.5, 1.5, logits.size(-1), device=logits.device)
        return F.nll_loss(F.log_softmax(logits.float(), -1).reshape(-1, logits.size(-1)), labels.reshape(-1),
                          weight=weight)


def manual_clip_lm(family: str = "llama"):
    """The zoo's Hugging Face model trained with manual optimization, as its users write it."""
    from tests.zoo_models import HFZooLM

    class ManualClipLM(HFZooLM):
        def __init__(self, family: str) -> None:
            super().__init__(family)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = self._loss(batch)
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)
            return loss

    return ManualClipLM(family)


class BertMLM(_CausalLM):
    """A BERT-style encoder (``BertForMaskedLM``, bidirectional attention) trained on masked-LM targets."""

    def __init__(self, vocab_size: int = VOCAB, hidden: int = 32, layers: int = 4, heads: int = 4):
        super().__init__()
        import transformers

        config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=2 * hidden,
                                         max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        self.model = transformers.BertForMaskedLM(config)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits
