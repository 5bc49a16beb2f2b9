"""Modules whose LM-head logits reach a loss as people write it, for the fused head-loss tests (issue #39);
nothing here knows lightning_4d.

- ``LabelsLM(family)``: a Hugging Face model of the zoo trained through its own loss (``labels=``; the labels
  are the next tokens already, passed as ``shift_labels`` too, as HF's own context-parallel recipe does).
- ``SmoothedLM(family)``: the explicit cross entropy with ``ignore_index`` and label smoothing, on the logits
  cast with ``.float()`` and reshaped; ``ShiftedLM(family)`` also drops the last position by slicing
  (``logits[:, :-1]``), which context parallelism refuses (a shard's last position is not the sequence's).
- ``AccuracyLM(family)``: the cross entropy and, from the same logits, an accuracy it logs.
- ``FusedHeadCount``: a probe that reports, summed over the ranks, how many cross entropies were computed in
  chunks and how many uses computed the logits whole.
- ``ChunkedEvenWhenSmall``: keeps the chunked path for heads small enough to run as written under GPipe (every
  test model's is), so that a GPipe case still tests the gradients formed in backward.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from tests.zoo_models import HFZooLM, zoo_lm


class LabelsLM(HFZooLM):
    def _loss(self, batch):
        input_ids, labels = batch
        return self.model(input_ids=input_ids, labels=labels, shift_labels=labels).loss


class SmoothedLM(HFZooLM):
    def _loss(self, batch):
        input_ids, labels = batch
        logits = self(input_ids).float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                               label_smoothing=0.1)


class ShiftedLM(HFZooLM):
    def _loss(self, batch):
        input_ids, labels = batch
        logits = self(input_ids)[:, :-1, :].float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, :-1].reshape(-1), ignore_index=-100,
                               label_smoothing=0.1)


class AccuracyLM(HFZooLM):
    def _loss(self, batch):
        input_ids, labels = batch
        logits = self(input_ids)
        accuracy = (logits.argmax(-1) == labels).float().mean()  # over every position: masked ones never match
        self.log("accuracy", accuracy, sync_dist=True)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def library_lm(family: str = "litgpt_llama"):
    return zoo_lm(family)


class FusedHeadCount(Callback):
    """Chunked cross entropies and whole-logits fallbacks of the fit, summed over every rank."""

    def parity_extras(self, trainer):
        fused = getattr(getattr(trainer.strategy, "parallel", None), "head_loss", None)
        counts = torch.tensor([fused.fused if fused else 0, fused.fallbacks if fused else 0, int(fused is not None),
                               int(fused is not None and fused.gradients_in_backward)])
        if dist.is_initialized():
            dist.all_reduce(counts)
        return {"fused": int(counts[0]), "fallbacks": int(counts[1]), "fused_heads": int(counts[2]),
                "gradients_in_backward": int(counts[3])}


class ChunkedEvenWhenSmall(Callback):
    def on_fit_start(self, trainer, pl_module):  # after the strategy's setup, which installed the fused head
        fused = getattr(getattr(trainer.strategy, "parallel", None), "head_loss", None)
        if fused is not None:
            fused.whole_elements = 0
