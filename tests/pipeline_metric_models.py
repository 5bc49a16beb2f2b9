"""A causal LM that logs torchmetrics Perplexity and macro F1 of its next-token predictions per step, as users
log them (``self.log(name, metric)`` after calling the metric); nothing here knows lightning_4d."""

import torch.nn.functional as F
import torchmetrics

from tests.lm_models import TINY_GPT, VOCAB, TinyGPT


class MetricGPT(TinyGPT):
    def __init__(self):
        super().__init__(**TINY_GPT)
        self.perplexity = torchmetrics.text.Perplexity()
        self.f1 = torchmetrics.classification.MulticlassF1Score(num_classes=VOCAB, average="macro")

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        logits = self(input_ids)
        self.perplexity(logits, labels)
        self.f1(logits.argmax(-1).flatten(), labels.flatten())
        self.log("train_ppl", self.perplexity)
        self.log("train_f1", self.f1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        self.log("train_loss", loss)
        return loss
