"""The example GPT with weight averaging, as Lightning users add it: Lightning's ``StochasticWeightAveraging``
callback, or an exponential moving average kept in a callback with ``torch.optim.swa_utils.AveragedModel``. Both
come from ``configure_callbacks`` so that the one-process reference runs them too; at the end of training each
puts the averaged weights into the module, so the final weights compared are the averages."""

import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging

from tests.lm_models import TINY_GPT, TinyGPT


class ExponentialAverage(Callback):
    """An exponential moving average of the weights kept beside them, one tensor per parameter, updated after every
    training batch and copied into the model at the end. Each average is a copy of what this rank holds of its
    parameter (a tensor-parallel or FSDP shard is a DTensor shard, a pipeline stage holds its own), so it works in
    every layout, where ``AveragedModel``'s deep copy of the module does not (docs/getting_started.md, "Weight averaging")."""

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay
        self.averages = []

    def on_fit_start(self, trainer, pl_module):
        self.averages = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for average, p in zip(self.averages, pl_module.parameters()):
                average.lerp_(p.detach(), 1 - self.decay)

    def on_train_end(self, trainer, pl_module):
        with torch.no_grad():
            for average, p in zip(self.averages, pl_module.parameters()):
                p.copy_(average)


class AveragedGPT(TinyGPT):
    def __init__(self, averaging: str = "swa", **config) -> None:
        super().__init__(**config)
        self.averaging = averaging

    def configure_callbacks(self):
        if self.averaging == "swa":  # averages from the second epoch on, at each epoch's end
            return [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)]
        return [ExponentialAverage()] if self.averaging == "ema" else []


def averaged_gpt(averaging: str = "swa") -> AveragedGPT:
    return AveragedGPT(averaging, **TINY_GPT)
