"""A test callback for runs under ``torchrun --max-restarts`` (tests/test_restarts.py), added to the example CLI's
callbacks with ``--trainer.callbacks+=tests.restart_probe.RestartProbe``. It does nothing unless
``RESTART_PROBE_OUT`` names a directory; there it writes, per rank, one JSON line per event with its wall-clock time
and attempt (``events-rank<r>.jsonl``), and rank 0 writes the final weights (``weights.pt``).

``RESTART_PROBE_KILL`` makes rank 1 SIGKILL itself: a comma-separated list whose i-th entry is for torchrun's
i-th attempt (``TORCHELASTIC_RESTART_COUNT`` i); attempts past the list run to the end. An entry is

* ``step:N``: as training step N begins (``global_step == N``);
* ``save:N``: while it writes its shard of the N-th checkpoint this attempt writes (half a file on disk and no
  ``meta.pt``: the save's ``.partial`` directory stays behind).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class RestartProbe(Callback):
    """See the module doc."""

    def __init__(self) -> None:
        self.out = Path(os.environ["RESTART_PROBE_OUT"]) if os.environ.get("RESTART_PROBE_OUT") else None
        entries = [entry for entry in os.environ.get("RESTART_PROBE_KILL", "").split(",") if entry]
        kind, _, value = entries[_attempt()].partition(":") if _attempt() < len(entries) else ("", "", "")
        self.kill = (kind, int(value)) if kind else None  # this attempt's
        self.rank = int(os.environ.get("RANK", "0"))  # torchrun's; the Trainer's once it exists
        self.first_step_seen = False
        self._event("built")  # the process is up: imports done, the CLI has parsed the config

    def _event(self, event: str, **fields) -> None:
        if self.out is None:
            return
        record = {"event": event, "t": time.time(), "attempt": _attempt(), "rank": self.rank, **fields}
        with open(self.out / f"events-rank{self.rank}.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
            os.fsync(file.fileno())  # the next thing this process does may be to die

    def _die(self, where: str, step: int) -> None:
        self._event("kill", step=step, where=where)
        print(f"restart probe: rank 1 SIGKILLs itself ({where})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _kills(self, kind: str) -> bool:
        return self.kill is not None and self.kill[0] == kind and self.rank == 1

    def _checkpoints(self, trainer) -> list[str]:
        folder = Path(trainer.checkpoint_callback.dirpath)
        return sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []

    def on_fit_start(self, trainer, pl_module) -> None:
        self.rank = trainer.global_rank
        if self._kills("save"):
            self._kill_while_writing(trainer, self.kill[1])

    def _kill_while_writing(self, trainer, nth: int) -> None:
        """Wrap DCP's file writer in this process: its ``nth`` write leaves half a shard, then this rank dies."""
        from torch.distributed.checkpoint import FileSystemWriter

        original, probe, writes = FileSystemWriter.write_data, self, [0]

        def write_data(writer, plan, planner):
            writes[0] += 1
            if writes[0] == nth:
                (Path(writer.path) / "__1_0.distcp").write_bytes(b"\0" * 512)
                probe._die(f"writing {Path(writer.path).name}", trainer.global_step)
            return original(writer, plan, planner)

        FileSystemWriter.write_data = write_data

    def on_train_start(self, trainer, pl_module) -> None:
        self._event("train_start", step=trainer.global_step, checkpoints=self._checkpoints(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._kills("step") and trainer.global_step == self.kill[1]:
            self._die("training step", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.first_step_seen:
            self.first_step_seen = True
            self._event("first_step", step=trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._event("save", step=trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        # Every rank takes part in gathering a sharded tensor; rank 0 writes the file.
        weights = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
                   for name, value in pl_module.state_dict().items()}
        self._event("train_end", step=trainer.global_step)
        if self.out is not None and trainer.global_rank == 0:
            torch.save(weights, self.out / "weights.pt")

    def teardown(self, trainer, pl_module, stage) -> None:
        # After ModelCheckpoint's last save and removal of older checkpoints: what a later run would find.
        self._event("teardown", checkpoints=self._checkpoints(trainer))
