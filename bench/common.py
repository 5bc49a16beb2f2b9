"""Pieces every benchmark shares: a step timer, the machine description, and where results go."""

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

RESULTS = Path(__file__).resolve().parent / "results"


class StepTimer(Callback):
    """Wall time of each training step (batch start to batch end), after ``warmup`` steps."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
