"""Exact mid-epoch resume for plain training DataLoaders.

Lightning restores its loop counters from a mid-epoch checkpoint but restarts a plain DataLoader from the
first batch of the epoch, so a resumed run trains on different batches than an uninterrupted one. A loader
that implements ``state_dict``/``load_state_dict`` is resumed by Lightning itself; the strategy turns the
training DataLoader into this subclass, which records how many batches training consumed in the current
epoch and, after a restore, skips them at the index level (no sample is loaded twice).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from lightning_4d import _compat as compat


class _SkipFirst:
    """The first ``count`` batches of index lists are dropped; iterated lazily so ``set_epoch`` still applies."""

    def __init__(self, batches: Iterable, count: int) -> None:
        self.batches, self.count = batches, count

    def __iter__(self) -> Iterator:
        yield from itertools.islice(self.batches, self.count, None)

    def __len__(self) -> int:
        return max(len(self.batches) - self.count, 0)


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning can checkpoint and restore mid-epoch (it implements ``state_dict``)."""

    consumed_batches = 0  # set by the strategy before every training batch
    _skip = 0

    def __iter__(self) -> Any:
        iterator = super().__iter__()
        self._skip = 0
        return iterator

    def __len__(self) -> int:
        # Lightning sizes the epoch from this; it stays the full epoch while the first batches are skipped.
        skip, self._skip = self._skip, 0
        try:
            return super().__len__()
        finally:
            self._skip = skip

    def state_dict(self) -> dict[str, int]:
        return {"consumed_batches": self.consumed_batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = self.consumed_batches = state["consumed_batches"]


compat.wrap_index_sampler(
    ResumableDataLoader, lambda loader, sampler: _SkipFirst(sampler, loader._skip) if loader._skip else sampler)


class TrainLoaders:
    """The training loaders of a fit, made resumable, told before every batch how many the epoch consumed."""

    def __init__(self) -> None:
        self.loaders: list[ResumableDataLoader] = []

    def clear(self) -> None:
        self.loaders.clear()

    def track(self, dataloader: Any) -> Any:
        dataloader = make_resumable(dataloader)
        if isinstance(dataloader, ResumableDataLoader):
            self.loaders.append(dataloader)
        return dataloader

    def consumed(self, batches: int, per_epoch: float) -> None:
        """``batches`` into the epoch; a checkpoint after its last batch resumes at the next epoch's start."""
        for loader in self.loaders:
            loader.consumed_batches = batches if per_epoch == float("inf") else batches % int(per_epoch)


def make_resumable(dataloader: Any) -> Any:
    """Resume support for a plain ``DataLoader``; any other loader is returned as it is."""
    if type(dataloader) is DataLoader:
        dataloader.__class__ = ResumableDataLoader
    return dataloader
