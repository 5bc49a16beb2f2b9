"""Pieces every benchmark shares: a step timer, trainers and data, worker processes, peak memory on CPU,
the machine description, and where results go."""

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

# ``BENCH_RESULTS`` redirects results (``python -m bench --quick`` keeps its smoke-size figures apart).
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
# Taken when a benchmark starts (its first import of this module): the machine is shared, so every result
# records how busy it was before and after.
LOAD_AT_START = os.getloadavg()


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


class CpuStepTimer(StepTimer):
    """Also the CPU time this process spends in each step, and the first step's wall time (start-up, compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: list[float] = []
        self.first = 0.0
        self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._cpu_start = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == 1:
            self.first = time.perf_counter() - self._start
        if trainer.global_step > self.warmup:
            self.cpu.append(time.process_time() - self._cpu_start)


def accelerator(devices: int) -> str:
    """``BENCH_ACCELERATOR`` (``cpu`` or ``gpu``, which ``python -m bench`` sets for each pass), else ``gpu``
    when there is one GPU per process, else ``cpu`` (gloo)."""
    return os.environ.get("BENCH_ACCELERATOR") or ("gpu" if torch.cuda.device_count() >= devices else "cpu")


def quiet_trainer(**kwargs) -> pl.Trainer:
    """A Trainer that measures only training: no logger, checkpoints, progress bar or summary."""
    return pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def random_tokens(samples: int, seq: int, vocab: int) -> TensorDataset:
    """``(input_ids, labels)`` pairs of random tokens, the same on every rank and every run."""
    tokens = torch.randint(0, vocab, (samples, seq + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def run_worker(script: str, args: list[str], timeout: float, env: dict | None = None) -> object:
    """Run ``script --worker ... --out FILE`` in a fresh process (Lightning's launcher there starts the other
    ranks of its Trainer) and return the JSON its rank 0 wrote to FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = [sys.executable, script, "--worker", *args, "--out", str(out)]
        # A session of its own, so that a hang ends with every rank Lightning's launcher started below it.
        proc = subprocess.Popen(argv, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{' '.join(argv)} did not finish within {timeout:.0f} s; killed it and its ranks")
        if code:
            raise subprocess.CalledProcessError(code, argv)
        return json.loads(out.read_text())


def run_layouts(script: str, specs: list[str], args: list[str], timeout: float, env: dict | None = None) -> list:
    """Rows of every layout in ``specs``: one ``script --worker --layouts ... --processes N`` launch per process
    count, its layouts one Trainer after another."""
    rows = []
    for count, group in by_processes(specs).items():
        rows += run_worker(script, ["--layouts", *group, "--processes", str(count), *args], timeout, env)
    return rows


def rounds_args() -> argparse.Namespace:
    """``--steps`` and ``--rounds`` of a script that alternates two strategies round by round."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def layout_parser(layouts: list[str], steps: int) -> argparse.ArgumentParser:
    """Arguments of a script measured through ``run_layouts``: its layouts and steps, and its workers'."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", nargs="+", default=layouts)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--out", default="")
    return parser


def write_rows(rows: list, out: str) -> None:
    """A worker's result, written once (by rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


# On CPU the peak is the resident set (``lightning_4d.telemetry.PeakMemory``). glibc keeps freed memory in its heap
# unless the process runs with a fixed mmap threshold; with this one freed tensors go back to the system and the
# resident set follows live tensors.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def layout(spec: str) -> dict[str, int]:
    """``"dp2pp2tp2"`` -> ``{"dp": 2, "pp": 2, "tp": 2}``; ``"single"`` -> ``{}`` (one process)."""
    if spec == "single":
        return {}
    parts = re.fullmatch(r"((dp|pp|cp|tp)\d+)+", spec) and re.findall(r"(dp|pp|cp|tp)(\d+)", spec)
    if not parts:
        raise ValueError(f"layout {spec!r}: write it as 'single' or like 'dp2pp2cp2tp2'")
    return {dim: int(size) for dim, size in parts}


def processes(spec: str) -> int:
    return math.prod(layout(spec).values())


def by_processes(specs: list[str]) -> dict[int, list[str]]:
    """Layouts grouped by process count: one launch of that many processes runs every layout of a group."""
    groups: dict[int, list[str]] = {}
    for spec in specs:
        groups.setdefault(processes(spec), []).append(spec)
    return groups


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def command(script: str) -> str:
    """The command line that reproduces this run."""
    return f"OMP_NUM_THREADS=1 python bench/{script} " + " ".join(sys.argv[1:])


def result_path(name: str) -> Path:
    """``results/NAME.json``; ``NAME_gpu.json`` in the GPU pass of ``python -m bench``, which keeps the CPU's."""
    return RESULTS / f"{name}{'_gpu' if os.environ.get('BENCH_ACCELERATOR') == 'gpu' else ''}.json"


def plot_if_possible(name: str, payload: dict) -> Path | None:
    """``bench/results/NAME.png`` from ``payload`` when matplotlib is installed (``pip install -e ".[bench]"``)."""
    from bench.report import plot

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    path = result_path(name).with_suffix(".png")
    return path if plot(name, payload, path) else None


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(name)
    loads = {"load_average_before": LOAD_AT_START, "load_average_after": os.getloadavg()}
    path.write_text(json.dumps({"machine": machine(), **loads, **payload}, indent=2))
    return path
