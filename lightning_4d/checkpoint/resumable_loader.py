"""Exact mid-epoch resume for plain training DataLoaders.

Lightning restores its loop counters from a mid-epoch checkpoint but restarts a plain DataLoader from the
first batch of the epoch, so a resumed run trains on different batches than an uninterrupted one. A loader
that implements ``state_dict``/``load_state_dict`` is resumed by Lightning itself; the strategy turns the
training DataLoader into this subclass, which records how many batches training consumed in the current
epoch and, after a restore, skips them at the index level (no sample is loaded twice).

The loader also keeps the epoch its sampler shuffles with (``set_epoch``) in its state. Restored, it shuffles
with that epoch (the next one when the checkpoint was taken after the epoch's last batch) and counts on from
there, whatever Lightning's loop counters say: they are one epoch ahead when a resume with more steps goes on
with an epoch that ``max_steps`` cut short. Not restored (a checkpoint of a finished epoch, or a new fit), it
starts with Lightning's epoch. After some resumes at an epoch's end Lightning's counters are off by one epoch
unless :func:`continue_as_uninterrupted` corrects them (``FourDStrategy.on_train_start`` calls it).
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
    next_epoch: Optional[int] = None  # the next epoch's (None: keep what Lightning set, and count on from it)
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
        if self.next_epoch is None:  # a fit's first epoch, not restored (or without an epoch): Lightning's stands
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
        """A fit's first training loader starts with Lightning's epoch (or its restored one); one reloaded during the
        fit where the one before it was."""
        dataloader = make_resumable(dataloader)
        if isinstance(dataloader, ResumableDataLoader):
            dataloader.next_epoch = self.loaders[-1].next_epoch if self.loaders else None
            self.loaders.append(dataloader)
        return dataloader

    def consumed(self, batches: int, per_epoch: float) -> None:
        """``batches`` into the epoch; a checkpoint after its last batch resumes at the next epoch's start."""
        for loader in self.loaders:
            loader.consumed_batches = batches if per_epoch == float("inf") else batches % int(per_epoch)


def continue_as_uninterrupted(trainer: Any) -> None:
    """Call after ``FitLoop.reset``, before the first epoch starts (the strategy's ``on_train_start``): two restarts
    at an epoch's end that Lightning continues differently from an uninterrupted run.

    * Taken at an epoch's last batch (``on_train_batch_end``): Lightning closes that epoch in ``FitLoop.reset``
      but keeps its "restarted mid-epoch" stage for the next one, which then starts without ``epoch_progress``
      counting it ready and started and without the ``on_train_epoch_start`` hooks. The counters stay one epoch
      behind for the rest of the fit, so every later checkpoint reads as one of a finished epoch: a run resumed
      from it counts its epochs one behind, and without ``max_steps`` also restores no loader position and
      shuffles them one behind.
    * Taken in ``on_train_epoch_end`` after an epoch's last batch, under ``max_steps`` (a finished epoch is
      restarted only then): Lightning resumes inside the finished epoch, trains the next epoch's first batch as
      one more batch of it, and shuffles every later epoch one ahead. (An epoch that ``max_steps`` cut short
      goes on where it stopped when a resume allows more steps, as Lightning does.)

    Either way the next epoch starts here as in an uninterrupted run."""
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    if loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end and epoch_loop.batch_progress.is_last_batch:
        loop.reset_restart_stage()
    elif loop.restarted_on_epoch_end and epoch_loop.batch_progress.is_last_batch:
        loop.epoch_progress.increment_completed()  # as Lightning does for this checkpoint without max_steps
        loop.reset_restart_stage()
        epoch_loop.restarting = False
        epoch_loop.reset_restart_stage()


def make_resumable(dataloader: Any) -> Any:
    """Resume support for a plain ``DataLoader``; any other loader is returned as it is."""
    if type(dataloader) is DataLoader:
        dataloader.__class__ = ResumableDataLoader
    return dataloader
