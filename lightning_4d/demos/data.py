"""Byte-level language-modelling data from text every machine already has offline."""

import os
import sysconfig

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

_THIRD_PARTY_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def read_stdlib_source(max_bytes: int) -> bytes:
    """Concatenate the standard library's ``.py`` files in sorted path order, up to ``max_bytes``.

    Third-party packages that happen to live under the stdlib folder are skipped so the
    corpus is the same on every machine with the same Python version.
    """
    chunks, total = [], 0
    for root, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in _THIRD_PARTY_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(root, name), "rb") as f:
                chunk = f.read(max_bytes - total)
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return b"".join(chunks)
    return b"".join(chunks)


def read_file(path: str, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the file at ``path``."""
    with open(path, "rb") as f:
        return f.read(max_bytes)


class TextDataModule(L.LightningDataModule):
    """Non-overlapping byte windows split, in order, into train | val | test.

    Each window holds ``seq_len + 1`` bytes and becomes ``(input_ids, labels)`` shifted by
    one. ``val_fraction`` of the windows go to validation and as many to test (which the
    predict loader reuses). All loaders drop the last partial batch so every batch has the
    same shape, which keeps microbatching and sequence sharding simple.
    """

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        raw = read_file(self.path, self.max_bytes) if self.path else read_stdlib_source(self.max_bytes)
        width = self.seq_len + 1
        n = len(raw) // width
        n_held = max(1, int(n * self.val_fraction))
        if n - 2 * n_held < 1:
            raise ValueError(f"{len(raw)} bytes give only {n} windows of {width}; need more text or a shorter seq_len")
        windows = torch.frombuffer(bytearray(raw[: n * width]), dtype=torch.uint8).long().view(n, width)
        inputs, labels = windows[:, :-1], windows[:, 1:]
        n_train = n - 2 * n_held
        self.train_set = TensorDataset(inputs[:n_train], labels[:n_train])
        self.val_set = TensorDataset(inputs[n_train : n_train + n_held], labels[n_train : n_train + n_held])
        self.test_set = TensorDataset(inputs[n_train + n_held :], labels[n_train + n_held :])

    def _loader(self, dataset: TensorDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
