"""Exact mid-epoch resume for plain training DataLoaders.

Lightning restores its loop counters from a mid-epoch checkpoint but restarts a plain DataLoader from the
first batch of the epoch, so a resumed run trains on different batches than an uninterrupted one. A loader
that implements ``state_dict``/``load_state_dict`` is resumed by Lightning itself; the strategy turns the
training DataLoader into this subclass, which records how many batches training consumed in the current
epoch and, after a restore, skips them at the index level (no sample is loaded twice).

The loader also keeps the epoch its sampler shuffles with (``set_epoch``) itself, in its state: Lightning
derives it from its loop counters, which are one epoch behind after a run that was itself resumed at an
epoch's end is resumed again at an epoch's end (its ``epoch_progress`` skips the new epoch's ``ready`` and
``started`` counts after such a restart), and the resumed run would repeat an epoch's data order. Counted here,
epoch ``e`` of a fit shuffles with ``e``, as in an uninterrupted run, however often it was resumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Optional

from torch.utils.data import DataLoader

from lightning_4d import _compat as compat


class _EpochStart:
    """The loader's index sampler, iterated lazily: when the first batch of an epoch is drawn (after Lightning's
    own ``set_epoch``) the loader sets its epoch, and the first ``count`` batches (a restored mid-epoch position;
    once) are dropped."""

    def __init__(self, loader: "ResumableDataLoader", batches: Iterable, count: int) -> None:
        self.loader, self.batches, self.count = loader, batches, count

    def __iter__(self) -> Iterator:
        self.loader.begin_epoch()
        count, self.count = self.count, 0  # a persistent-workers iterator iterates this again next epoch
        yield from itertools.islice(self.batches, count, None)

    def __len__(self) -> int:
        return max(len(self.batches) - self.count, 0)


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning can checkpoint and restore mid-epoch (it implements ``state_dict``)."""

    consumed_batches = 0  # set by the strategy before every training batch
    epoch: Optional[int] = None  # the epoch the sampler shuffles this epoch's batches with
    next_epoch: Optional[int] = 0  # the next epoch's (None: keep what Lightning set, and count on from it)
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

    def begin_epoch(self) -> None:
        samplers = [self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)]
        if self.next_epoch is None:  # restored from a checkpoint without an epoch: Lightning's value stands
            self.epoch = next((s.epoch for s in samplers if isinstance(getattr(s, "epoch", None), int)), None)
        else:
            self.epoch = self.next_epoch
            for index, sampler in enumerate(samplers):
                if hasattr(sampler, "set_epoch") and all(sampler is not other for other in samplers[:index]):
                    sampler.set_epoch(self.epoch)
        self.next_epoch = None if self.epoch is None else self.epoch + 1

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_batches": self.consumed_batches, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skip = self.consumed_batches = state["consumed_batches"]
        epoch = state.get("epoch")
        # Taken after an epoch's last batch (nothing consumed of the next): the next epoch; else this one again.
        self.next_epoch = None if epoch is None else epoch + (0 if self.consumed_batches else 1)


compat.wrap_index_sampler(ResumableDataLoader, lambda loader, sampler: _EpochStart(loader, sampler, loader._skip))


class TrainLoaders:
    """The training loaders of a fit, made resumable, told before every batch how many the epoch consumed."""

    def __init__(self) -> None:
        self.loaders: list[ResumableDataLoader] = []

    def clear(self) -> None:
        self.loaders.clear()

    def track(self, dataloader: Any) -> Any:
        """A fit's training loader starts at epoch 0, or, reloaded during the fit, where the one before it was."""
        dataloader = make_resumable(dataloader)
        if isinstance(dataloader, ResumableDataLoader):
            dataloader.next_epoch = self.loaders[-1].next_epoch if self.loaders else 0
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
