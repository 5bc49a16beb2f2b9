"""A ``BasePredictionWriter`` writes each predicted sample once, as under DDP.

Every rank of a replica predicts the same samples (prediction runs whole sequences, and the pipeline gives every
stage the last one's outputs): one of them, the tp and cp rank 0 of the last stage, writes; on the others the
writers' methods are shadowed while predicting.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter, Callback


def _write_nothing(*_: Any, **__: Any) -> None:
    return None


class PredictionWriters(Callback):
    """Added by the strategy: while predicting, the writers of a rank that does not write do nothing."""

    def __init__(self) -> None:
        self._silenced: list[BasePredictionWriter] = []

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        mesh, dims = trainer.strategy.mesh, trainer.strategy.parallel_dims
        writes = mesh.local_rank("tp") == 0 and mesh.local_rank("cp") == 0 and mesh.local_rank("pp") == dims.pp - 1
        self._silenced = [] if writes else [c for c in trainer.callbacks if isinstance(c, BasePredictionWriter)]
        for callback in self._silenced:  # instance attributes shadow the writer's methods
            callback.write_on_batch_end = callback.write_on_epoch_end = _write_nothing

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        for callback in self._silenced:
            del callback.write_on_batch_end, callback.write_on_epoch_end
        self._silenced = []


def attach(callbacks: list) -> None:
    """Add :class:`PredictionWriters` to the Trainer's ``callbacks`` unless it is there."""
    if not any(isinstance(c, PredictionWriters) for c in callbacks):
        callbacks.append(PredictionWriters())
