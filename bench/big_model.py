"""Memory per rank of a Hugging Face Llama built whole on every rank against built on the meta device and loaded
from a Hugging Face directory, under tp, dp_shard, pp and tp x dp_shard, against one process (issue #27).

    OMP_NUM_THREADS=1 python bench/big_model.py                # 0.6 GB and 2 GB fp32 Llamas, every layout
    OMP_NUM_THREADS=1 python bench/big_model.py --sizes tiny --layouts single tp2 --steps 2   # a smoke run
    OMP_NUM_THREADS=1 python bench/big_model.py --huge --steps 2   # a 6.6 GB Llama at tp2 x dp_shard2, meta-built
    OMP_NUM_THREADS=1 python bench/big_model.py --optimizer adamw --builds meta --layouts single tp2 dp_shard2 \
        dp_shard2_modules pp2                                     # the training peak with AdamW's two states

Why: a model that does not fit one rank can only train if no rank ever holds all of it, from construction to
the first optimizer step. #27 sets the goals this script checks and prints, per layout:

- meta-built, the setup peak of each rank (resident memory from before construction to the start of the first
  training step: the build, the layout, the storage of its shards, the load and the optimizer) stays within
  0.55 x the model's bytes above what the rank held before construction at 2 ranks, 0.30 x at 4. A meta-built
  model is constructed in ``configure_model``, after Lightning has started the process group, so "before
  construction" is the resident set when ``configure_model`` starts (a whole-built model is constructed before
  the Trainer exists: there it is the resident set at the start of the process); the table also shows the
  growth from the start of the process;
- the training peak of each rank (resident memory during steady-state steps, above the same starting point)
  is at most 0.55 x one process's at 2 ranks.

Each configuration runs in its own processes (``bench.common.run_worker``; Lightning starts the other ranks),
with a fixed glibc mmap threshold (``CPU_MALLOC_ENV``) so that freed tensors leave the resident set. Every rank
records its resident set before the model is built (``/proc/self/statm``), the high-water mark ``VmHWM`` at
the start of the first step (the setup peak; a thread splits it into allocations and mapped file pages), over
the first step, and over the later steps (reset through ``/proc/self/clear_refs`` in between), and its
resident set at the end of the last step. SGD without momentum keeps no optimizer state, and batches of 4
sequences of 16 tokens keep activations small, so what grows is the model: weights, and gradients during steps.
That is the hardest case for sharded data parallelism, whose per-unit transients (a unit's gathered weights, its
unsharded gradient and FSDP's reduce-scatter copy of it) are then compared with only two copies of the model;
``--optimizer adamw`` measures the training peak with AdamW's two states per weight instead, as people train
(and as #27's own first measurement did), into ``big_model_adamw.json``.

Whole-built, every rank builds and initializes the whole model in the LightningModule's constructor and
FourDStrategy broadcasts rank 0's weights in bounded buckets. Meta-built, ``configure_model`` builds it under
``trainer.init_module(empty_init=True)`` and ``FourDStrategy(init_from=DIR)`` fills each rank's shards from a
directory written once beforehand by ``save_pretrained`` (safetensors), next to a ``torch.save`` of the same
weights. After training, each meta-built rank times loading the directory again into its shards and
``torch.load`` of the whole ``torch.save`` file (what loading cost before streaming). The files were just
written, so both read from the page cache.

``--huge`` trains a 6.6 GB Llama (whole on each of 4 ranks: 26.5 GB, more than this 24 GiB machine), meta-built at
tp2 x dp_shard2 from a directory this script writes shard by shard (never the whole model in memory) under
``--dir`` and deletes afterwards. Results: ``bench/results/big_model.json`` (``big_model_huge.json`` for
``--huge``) and ``big_model.png``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CPU_MALLOC_ENV, RssSampler, command, llama_config, llama_params, plot_if_possible,  # noqa: E402
                          proc_status, quiet_trainer, random_tokens, rss_bytes, run_worker, save_llama, write,
                          write_rows)
from bench.report import plot, table  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.observability.telemetry import PeakMemory  # noqa: E402

# Width and depth of each model; fp32 bytes are 4 x llama_params (0.60, 2.01 and 6.63 GB). The largest is just
# over what 4 whole copies in 24 GiB allow (4 x 6.63 GB = 24.7 GiB), and deep and narrow (decoder layers of
# 0.42 GB) because FSDP gathers a whole layer's tensor-parallel shard at a time, and a few of them at once: on
# this shared 24 GiB machine, 1 GB layers would not leave enough room.
SIZES = {"tiny": dict(hidden=128, layers=2, vocab=1024, heads=4),
         "0.6GB": dict(hidden=1024, layers=8, vocab=8192, heads=8),
         "2GB": dict(hidden=1536, layers=12, vocab=16384, heads=12),
         "6.6GB": dict(hidden=2560, layers=15, vocab=16384, heads=20)}
LAYOUTS = {"single": {}, "tp2": {"tp": 2}, "dp_shard2": {"dp_shard": 2},
           "dp_shard2_modules": {"dp_shard": 2, "shard_units": "modules"}, "pp2": {"pp": 2},
           "tp2dp_shard2": {"tp": 2, "dp_shard": 2}}
BUILDS = ("whole", "meta")
# Per rank; pp's default 2 * pp micro-batches take one sequence each.
BATCH, SEQ = 4, 16
# The goals of #27: setup growth over model bytes (meta-built) by process count, training peak over one process's.
SETUP_GOAL = {2: 0.55, 4: 0.30}
TRAIN_GOAL = {2: 0.55}
TIMEOUT_S = 3600
GB = 1e9


def _processes(spec: str) -> int:
    dims = LAYOUTS[spec]
    return dims.get("tp", 1) * dims.get("dp_shard", 1) * dims.get("pp", 1)


class LlamaLM(pl.LightningModule):
    """A Hugging Face Llama trained on next tokens with SGD without momentum: built whole in the constructor, or
    on the meta device in ``configure_model`` (once: Lightning calls it again for validate/test/predict)."""

    def __init__(self, config: transformers.LlamaConfig, meta: bool, optimizer: str = "sgd") -> None:
        super().__init__()
        self.llama_config = config
        self.optimizer = optimizer
        self.model = None if meta else transformers.LlamaForCausalLM(config)

    def configure_model(self) -> None:
        if self.model is None:
            self.before_construction = _memory_now()
            with self.trainer.init_module(empty_init=True):
                self.model = transformers.LlamaForCausalLM(self.llama_config)

    def training_step(self, batch, batch_idx):
        input_ids, _ = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss  # the model shifts the labels itself

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-4)
        return torch.optim.SGD(self.parameters(), lr=1e-4)  # no momentum: no optimizer state


class _Probe(Callback):
    """One rank's memory and times from before construction to the end of training (see the module's docstring);
    rank 0 writes every rank's record to ``out``."""

    def __init__(self, before: int, start: float, sampler: RssSampler, reload: Path | None, out: str) -> None:
        self.memory = PeakMemory(torch.device("cpu"))
        self.record: dict = {"before": before, "before_anon": sampler.start["RssAnon"],
                             "before_file": sampler.start["RssFile"], "step_s": []}
        self.record["from"] = {"rss": before, "anon": sampler.start["RssAnon"], "file": sampler.start["RssFile"]}
        self.start, self.sampler, self.reload, self.out = start, sampler, reload, out
        self._step_start = 0.0

    def on_train_start(self, trainer, pl_module):
        self.record["setup_s"] = time.perf_counter() - self.start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.sampler.__exit__(None, None, None)
            self.record["constructed_from"] = getattr(pl_module, "before_construction", None) or self.record["from"]
            self.record.update(setup_peak=self.memory.peak(), setup_anon_peak=self.sampler.peaks["RssAnon"],
                               setup_file_peak=self.sampler.peaks["RssFile"])
            self.memory.start()
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["step_s"].append(time.perf_counter() - self._step_start)
        if batch_idx == 0:
            self.record["first_step_peak"] = self.memory.peak()
            self.memory.start()
        if batch_idx == trainer.max_steps - 1:
            self.record.update(train_peak=self.memory.peak(), end_rss=rss_bytes())

    def on_train_end(self, trainer, pl_module):
        self.record["held_bytes"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                                        for p in pl_module.parameters())
        if self.reload is not None:
            self._time_loads(trainer)
        ranks = [self.record]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, self.record)
        write_rows(ranks, self.out)

    def _time_loads(self, trainer) -> None:
        """The Hugging Face directory streamed into this rank's shards again, then ``torch.load`` of the whole
        ``torch.save`` file, each started together on every rank."""
        barrier = dist.barrier if dist.is_initialized() else (lambda: None)
        barrier()
        start = time.perf_counter()
        trainer.strategy.parallel.load_weights(str(self.reload / "hf"))
        self.record["hf_load_s"] = time.perf_counter() - start
        barrier()
        start = time.perf_counter()
        whole = torch.load(self.reload / "state_dict.pt", map_location="cpu", weights_only=True)
        self.record["torch_load_s"] = time.perf_counter() - start
        del whole
        barrier()


def _memory_now() -> dict:
    """This process's resident set, and its anonymous and file-backed parts, in bytes."""
    parts = proc_status("RssAnon", "RssFile")
    return {"rss": rss_bytes(), "anon": parts["RssAnon"], "file": parts["RssFile"]}


def _worker(args: argparse.Namespace) -> None:
    """One configuration; this process is one of its ranks (Lightning starts the others with the same argv)."""
    gc.collect()
    before, start = rss_bytes(), time.perf_counter()
    sampler = RssSampler().__enter__()  # stopped at the first step by the probe
    root = Path(args.dir) / args.size
    meta = args.build == "meta"
    module = LlamaLM(llama_config(**SIZES[args.size]), meta=meta, optimizer=args.optimizer)
    reload = root if meta and (root / "state_dict.pt").is_file() else None
    probe = _Probe(before, start, sampler, reload, args.out)
    strategy = FourDStrategy(**LAYOUTS[args.layout], tp_self_check=False,
                             init_from=str(root / "hf") if meta else None)
    trainer = quiet_trainer(accelerator="cpu", devices=_processes(args.layout), strategy=strategy,
                            max_steps=args.steps, callbacks=[probe])
    data = random_tokens(BATCH * args.steps * 4, SEQ, module.llama_config.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=BATCH))


def _shard_of(name: str, layers_per_file: int) -> str:
    """The file of a tensor: ``layers_per_file`` decoder layers per file, one for the embedding, one for the final
    norm and the head."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        return f"layers{int(layer.group(1)) // layers_per_file:03d}"
    return "embed" if "embed_tokens" in name else "head"


def write_sharded(config: transformers.LlamaConfig, directory: Path) -> int:
    """A Hugging Face directory (``config.json``, safetensors shards of at most about 1 GB and their index) of a
    Llama with seeded random weights, written one shard at a time: the model is built on the meta device for
    its names and shapes, and only the tensors of the shard being written exist (two decoder layers, 0.84 GB,
    at the 6.6 GB size).
    Weights are drawn as ``_init_weights`` draws them (normal, std ``initializer_range``; norms one), each from
    a generator seeded by its name. Returns the bytes of weights written."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in transformers.LlamaForCausalLM(config).state_dict().items()}
    layer_bytes = sum(shape.numel() * 4 for name, shape in shapes.items() if name.startswith("model.layers.0."))
    layers_per_file = max(1, int(1e9 // layer_bytes))
    groups: dict[str, list[str]] = {}
    for name in shapes:
        groups.setdefault(_shard_of(name, layers_per_file), []).append(name)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for index, names in enumerate(groups.values(), 1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            if name.endswith("norm.weight"):
                shard[name] = torch.ones(shapes[name])
            else:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                shard[name] = torch.empty(shapes[name]).normal_(0.0, config.initializer_range, generator=generator)
            weight_map[name] = file
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        del shard
    total = sum(shape.numel() * 4 for shape in shapes.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(directory)
    return total


def _prepare(args: argparse.Namespace) -> None:
    """The weights the meta-built runs load, in a process of their own (it may hold the whole model)."""
    root = Path(args.dir) / args.prepare
    config = llama_config(**SIZES[args.prepare])
    if args.sharded:
        if not (root / "hf" / "model.safetensors.index.json").is_file():
            start = time.perf_counter()
            written = write_sharded(config, root / "hf")
            print(f"wrote {written / GB:.2f} GB to {root / 'hf'} shard by shard in {time.perf_counter() - start:.0f} s"
                  f" (peak resident {PeakMemory(torch.device('cpu')).peak() / GB:.2f} GB)", flush=True)
    else:
        save_llama(config, root, max_shard_size="500MB")


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _wait_for_memory(need: float, wait_s: float = 1800) -> None:
    """Wait (the machine is shared) until ``need`` bytes and 3 GB to spare are available; fail after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while _available_bytes() < need + 3 * GB:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{need / GB:.1f} GB (+3 GB) never became available: {_available_bytes() / GB:.1f} GB")
        print(f"  waiting: {_available_bytes() / GB:.1f} GB available, this run may need {need / GB:.1f} GB + 3",
              flush=True)
        time.sleep(30)


def _need(model_bytes: int, spec: str, build: str, reload: bool, optimizer: str) -> float:
    """What one configuration may hold over all its ranks, from the measurements: 0.4 GB of allocations of the
    interpreter and libraries per rank (their mapped files are shared); whole-built, the model while it is
    built and broadcast; in training, weights and gradients (and AdamW's two states) of the rank's share and
    30% for the layers FSDP gathers; meta-built with a ``torch.save`` file, the whole model per rank for the ``torch.load`` after
    training."""
    ranks = _processes(spec)
    training = (2.3 if optimizer == "sgd" else 4.6) * model_bytes / ranks
    per_rank = max(training, 1.2 * model_bytes if build == "whole" else 0, model_bytes if reload else 0)
    return ranks * (0.4 * GB + per_rank)


def _run(args: argparse.Namespace, size: str, spec: str, build: str, steps: int, model_bytes: int) -> dict:
    _wait_for_memory(_need(model_bytes, spec, build, reload=(Path(args.dir) / size / "state_dict.pt").is_file(),
                           optimizer=args.optimizer))
    start = time.perf_counter()
    ranks = run_worker(__file__, ["--size", size, "--layout", spec, "--build", build, "--steps", str(steps),
                                  "--dir", args.dir, "--optimizer", args.optimizer], TIMEOUT_S, env=CPU_MALLOC_ENV)
    row = {"size": size, "layout": spec, "build": build, "processes": len(ranks), "model_bytes": model_bytes,
           "wall_s": time.perf_counter() - start, "ranks": ranks}
    heaviest = lambda key: max(r[key] - r["before"] for r in ranks)  # noqa: E731
    row.update(setup_growth=max(r["setup_peak"] - r["constructed_from"]["rss"] for r in ranks),
               setup_growth_from_start=heaviest("setup_peak"), first_step_growth=heaviest("first_step_peak"),
               train_growth=heaviest("train_peak"), end_growth=heaviest("end_rss"),
               setup_anon_growth=max(r["setup_anon_peak"] - r["constructed_from"]["anon"] for r in ranks),
               setup_file_growth=max(r["setup_file_peak"] - r["constructed_from"]["file"] for r in ranks),
               before_construction=max(r["constructed_from"]["rss"] for r in ranks),
               before=max(r["before"] for r in ranks), held_bytes=max(r["held_bytes"] for r in ranks),
               setup_s=max(r["setup_s"] for r in ranks),
               step_s=max(r["step_s"][-1] for r in ranks))
    row["setup_over_model"] = row["setup_growth"] / model_bytes
    if "hf_load_s" in ranks[0]:
        row.update(hf_load_s=max(r["hf_load_s"] for r in ranks), torch_load_s=max(r["torch_load_s"] for r in ranks))
    print(f"  {size} {spec} {build}: setup +{row['setup_growth'] / GB:.2f} GB ({row['setup_over_model']:.2f} x model),"
          f" training +{row['train_growth'] / GB:.2f} GB, {row['wall_s']:.0f} s", flush=True)
    return row


def _judge(rows: list[dict]) -> None:
    """Each row's ratios against #27's goals, in place: ``setup_goal``/``train_goal`` (None when the issue sets
    none for that build and process count) and whether each is met. The setup goal is judged twice: on the
    high-water mark of the resident set, and on its anonymous part alone, since the resident set also counts
    the pages of the memory-mapped safetensors files a rank has read (page cache, shared by the ranks of a
    host and dropped under pressure, not memory the rank allocated)."""
    single = {(r["size"], r["build"]): r["train_growth"] for r in rows if r["layout"] == "single"}
    for row in rows:
        n = row["processes"]
        row["setup_goal"] = SETUP_GOAL.get(n) if row["build"] == "meta" else None
        row["setup_anon_over_model"] = row["setup_anon_growth"] / row["model_bytes"]
        for key in ("setup", "setup_anon"):
            goal = row["setup_goal"]
            row[f"{key}_met"] = None if goal is None else row[f"{key}_over_model"] <= goal
        one = single.get((row["size"], row["build"]))
        row["train_vs_single"] = row["train_growth"] / one if one else None
        row["train_goal"] = TRAIN_GOAL.get(n) if one else None
        row["train_met"] = None if row["train_goal"] is None else row["train_vs_single"] <= row["train_goal"]


def _rejudge(path: Path) -> None:
    """The table and plot of results already measured (``--from-json``), judged again: nothing is rerun and the
    measured figures, load averages and machine stay as they were written."""
    payload = json.loads(path.read_text())
    _judge(payload["rows"])
    path.write_text(json.dumps(payload, indent=2))
    print(table("big_model", payload))
    if path.stem == "big_model":
        plot("big_model", payload, path.with_suffix(".png"))


def _sizes_payload(names: list[str]) -> dict:
    sizes = {}
    for name in names:
        params = llama_params(llama_config(**SIZES[name]))
        sizes[name] = dict(SIZES[name], intermediate=4 * SIZES[name]["hidden"], params=params, model_bytes=4 * params)
    return sizes


def _huge(args: argparse.Namespace) -> None:
    size, spec = "6.6GB", "tp2dp_shard2"
    sizes = _sizes_payload([size])
    model_bytes = sizes[size]["model_bytes"]
    print(f"Llama {size}: {sizes[size]['params'] / 1e9:.2f}B parameters, {model_bytes / GB:.2f} GB fp32;"
          f" whole on each of 4 ranks: {4 * model_bytes / GB:.1f} GB")
    root = Path(args.dir) / size
    try:
        start = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--prepare", size, "--sharded", "--dir", args.dir], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **CPU_MALLOC_ENV))
        written_s = time.perf_counter() - start
        row = _run(args, size, spec, "meta", args.steps, model_bytes)
        row["write_s"] = written_s
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _judge([row])
    payload = {"command": command("big_model.py"), "sizes": sizes, "batch_per_rank": BATCH, "seq": SEQ,
               "steps": args.steps, "rows": [row]}
    print(table("big_model", payload))
    steps = ", ".join(f"{max(r['step_s'][i] for r in row['ranks']):.1f}" for i in range(args.steps))
    print(f"directory written in {row['write_s']:.0f} s; setup {row['setup_s']:.0f} s; steps {steps} s (slowest rank);"
          f" peak per rank {max(max(r['setup_peak'], r['first_step_peak'], r['train_peak']) for r in row['ranks']) / GB:.2f}"
          f" GB resident ({row['before'] / GB:.2f} GB before construction)")
    print(f"(written to {write('big_model_huge', payload)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.6GB", "2GB"], choices=[s for s in SIZES if s != "6.6GB"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--builds", nargs="+", default=list(BUILDS), choices=BUILDS)
    parser.add_argument("--steps", type=int, default=3, help="training steps; the training peak is over all but the first")
    parser.add_argument("--dir", default="/tmp/lightning_4d_big_model", help="where the weights are written")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="sgd: no momentum, no optimizer state; adamw: two states per weight (big_model_adamw.json)")
    parser.add_argument("--keep", action="store_true", help="keep the written weights (deleted by default)")
    parser.add_argument("--huge", action="store_true", help="only the 6.6 GB model, meta-built at tp2 x dp_shard2")
    parser.add_argument("--from-json", help="judge and print results already written (no run)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--size", choices=list(SIZES))
    parser.add_argument("--layout", choices=list(LAYOUTS))
    parser.add_argument("--build", choices=BUILDS)
    parser.add_argument("--out", default="")
    parser.add_argument("--prepare", choices=list(SIZES))
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the training peak is measured after the first step")
    if args.worker:
        _worker(args)
        return
    if args.prepare:
        _prepare(args)
        return
    if args.from_json:
        _rejudge(Path(args.from_json))
        return
    if args.huge:
        _huge(args)
        return
    sizes = _sizes_payload(args.sizes)
    rows = []
    for size in args.sizes:
        print(f"Llama {size}: {sizes[size]['params'] / 1e6:.0f}M parameters, {sizes[size]['model_bytes'] / GB:.2f}"
              " GB fp32", flush=True)
        try:
            if "meta" in args.builds:
                subprocess.run([sys.executable, __file__, "--prepare", size, "--dir", args.dir], check=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            for spec in args.layouts:
                for build in args.builds:
                    rows.append(_run(args, size, spec, build, args.steps, sizes[size]["model_bytes"]))
        finally:
            if not args.keep:
                shutil.rmtree(Path(args.dir) / size, ignore_errors=True)
    _judge(rows)
    payload = {"command": command("big_model.py"), "sizes": sizes, "batch_per_rank": BATCH, "seq": SEQ,
               "steps": args.steps, "optimizer": args.optimizer, "rows": rows}
    print(table("big_model", payload))
    if args.optimizer == "adamw":  # the training peak only: the setup figures and their plot are the SGD run's
        path, drawn = write("big_model_adamw", payload), None
    else:
        path, drawn = write("big_model", payload), plot_if_possible("big_model", payload)
    print(f"(written to {path}{f' and {drawn}' if drawn else ''})")


if __name__ == "__main__":
    main()
