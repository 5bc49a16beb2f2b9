"""Pieces every benchmark shares: a step timer, trainers and data, worker processes, peak memory on CPU,
the Hugging Face Llama the memory benchmarks build and save, the machine description, and where results go."""

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
import threading
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


# On CPU the peak is the resident set (``lightning_4d.observability.telemetry.PeakMemory``). glibc keeps freed memory in its heap
# unless the process runs with a fixed mmap threshold; with this one freed tensors go back to the system and the
# resident set follows live tensors.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def proc_status(*keys: str) -> dict[str, int]:
    """Sizes from Linux's ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``) and, for
    ``rchar``, the bytes this process read with ``read()`` (``/proc/self/io``)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            fields[key] = int(value.split()[0]) * 1024
    if "rchar" in keys:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "rchar":
                fields[key] = int(value)
    return fields


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``), cheaper than parsing ``status``."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """The peaks of anonymous memory (allocations) and of file-backed pages (bytes mapped from files, such as
    memory-mapped safetensors) in the resident set, sampled every ``interval`` seconds by a thread while the
    ``with`` block runs: the high-water mark ``VmHWM`` has no such split. A short peak between samples is
    missed, so the split explains ``VmHWM`` rather than replacing it."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.start = proc_status("RssAnon", "RssFile")
        self.peaks = dict(self.start)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            for key, value in proc_status("RssAnon", "RssFile").items():
                self.peaks[key] = max(self.peaks[key], value)
            time.sleep(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def llama_config(hidden: int, layers: int, vocab: int, heads: int = 8, intermediate: int | None = None):
    """A Hugging Face ``LlamaConfig`` from its width and depth (MLP ``4 * hidden`` unless given, untied head, as
    many key/value heads as heads): the model the memory benchmarks build, of ``llama_params`` parameters."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256, tie_word_embeddings=False,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=None)


def llama_params(config) -> int:
    """Parameters of ``LlamaForCausalLM(config)``, counted on the meta device (no memory)."""
    import transformers

    with torch.device("meta"):
        return sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())


def save_llama(config, root: Path, max_shard_size: str) -> None:
    """The same randomly initialized weights (seed 0) twice under ``root``: ``hf/`` with ``save_pretrained``
    (safetensors shards of at most ``max_shard_size`` with an index) and ``state_dict.pt`` with ``torch.save``.
    Kept when already there. This process holds the whole model while it writes."""
    import transformers

    if (root / "state_dict.pt").is_file():
        return
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "hf", max_shard_size=max_shard_size)
    torch.save(model.state_dict(), root / "state_dict.pt")


def layout(spec: str) -> dict[str, int]:
    """``"dp2pp2tp2"`` -> ``{"dp": 2, "pp": 2, "tp": 2}``; ``"single"`` -> ``{}`` (one process); ``ep`` (expert
    parallelism, ``"dp4ep4"``) borrows its ranks from dp and adds none."""
    if spec == "single":
        return {}
    parts = re.fullmatch(r"((dp|pp|cp|tp|ep)\d+)+", spec) and re.findall(r"(dp|pp|cp|tp|ep)(\d+)", spec)
    if not parts:
        raise ValueError(f"layout {spec!r}: write it as 'single' or like 'dp2pp2cp2tp2'")
    return {dim: int(size) for dim, size in parts}


def processes(spec: str) -> int:
    return math.prod(size for dim, size in layout(spec).items() if dim != "ep")


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


class StepTimes(Callback):
    """Each training step's wall and CPU time and the peak memory growth (``memory``), every rank's, gathered on
    every rank in ``ranks`` when training ends."""

    def __init__(self, memory) -> None:
        self.memory, self.wall, self.cpu, self.ranks = memory, [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])

    def on_train_end(self, trainer, pl_module):
        mine = {"wall": self.wall, "cpu": self.cpu, "peak": self.memory.growth()}
        self.ranks = [None] * trainer.world_size
        dist.all_gather_object(self.ranks, mine)
