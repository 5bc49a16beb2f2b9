"""A ``BasePredictionWriter`` writes each predicted sample once, as under DDP.

Every rank of a replica predicts the same samples (prediction runs whole sequences, and the pipeline gives every
stage the last one's outputs): one of them, the tp and cp rank 0 of the last stage, writes; on the others the
writers' methods are shadowed while predicting.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter


def _write_nothing(*_: Any, **__: Any) -> None:
    return None


class PredictionWriters:
    def __init__(self) -> None:
        self._silenced: list[BasePredictionWriter] = []

    def start(self, callbacks: list[Any], writes: bool) -> None:
        """Before predicting: silence every prediction writer unless this rank ``writes``."""
        self._silenced = [] if writes else [c for c in callbacks if isinstance(c, BasePredictionWriter)]
        for callback in self._silenced:  # instance attributes shadow the writer's methods
            callback.write_on_batch_end = callback.write_on_epoch_end = _write_nothing

    def end(self) -> None:
        for callback in self._silenced:
            del callback.write_on_batch_end, callback.write_on_epoch_end
        self._silenced = []
