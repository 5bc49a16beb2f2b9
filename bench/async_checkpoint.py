"""Checkpoint saves that never stop training: synchronous against asynchronous saves per layout, and save and
load time against the world size with and without DCP's plan caching.

    OMP_NUM_THREADS=1 python bench/async_checkpoint.py [--layouts dp2 dp_shard2 tp2 pp2] [--saves 20] [--sync-saves 5]
        [--rounds 1]
    OMP_NUM_THREADS=1 python bench/async_checkpoint.py --scaling [--worlds 2 4 8 16] [--repeats 3]

Layouts: the example GPT (12 layers, n_embd 768, vocabulary 256: 85M parameters, whose weights and AdamW state make
1.0 GB) trains with ``trainer.save_checkpoint`` every ``--every`` steps: ``--sync-saves`` times with
``FourDStrategy(async_save=False)``, ``--saves`` times with ``True`` (separate launches). Per save, the time
``save_checkpoint`` held the step (the slowest rank); per step, its wall time and whether a background write was
running while it ran; each rank's resident memory before the first save, after the 2nd and after the last. A
save holds the step from the moment the last rank calls ``save_checkpoint`` to the moment the last rank returns
(a rank that arrives early waits for the others at the step's next collective anyway, save or not); each rank's
own wait is kept beside it. The step-time ratio compares steps that ran during a background write with the
median step of the synchronous run. ``--rounds R`` runs every layout's synchronous and asynchronous launches R
times, alternating, so that each ratio compares launches minutes apart (this machine's step time drifts by 20-40%
over tens of minutes).

Writers (``--writers``): which background writer costs training least. Two processes each hold ``--mb`` MB of
tensors and run a CPU-bound loop (matrix products) standing in for training steps; each of 3 saves is written by
the package's writer process (``process``: DCP's data-writing phase in a process at nice +10), by the same save
with DCP's file writer in the coordinating thread at nice +10 (``thread``: the package before 2026-12-02), and by
DCP's own process-based ``async_save`` (``AsyncCheckpointerType.PROCESS``, shared-memory staging); per kind, the
time the save call held the loop, how long the write took, and the loop's step time during writes against without.

Scaling (``--scaling``): the same total state (a 32M-parameter GPT with AdamW: 0.38 GB) sharded with
``dp_shard=N`` over N processes, each saving and loading it ``--repeats`` times (best of), with plan caching (the
package's default) and without it (``DefaultSavePlanner()`` each save).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CPU_MALLOC_ENV, accelerator, command, layout, quiet_trainer, random_tokens,  # noqa: E402
                          rss_bytes, run_worker, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.checkpoint import sharded  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402

BIG = dict(vocab_size=256, n_layer=12, n_head=12, n_embd=768, block_size=64)
SCALING = dict(vocab_size=256, n_layer=8, n_head=8, n_embd=576, block_size=64)
BATCH, SEQ = 2, 64  # per replica
TIMEOUT_S = 1800


def _layout(spec: str) -> dict:
    dims = {"dp_shard": int(spec[len("dp_shard"):])} if spec.startswith("dp_shard") else layout(spec)
    return dict(dims, pp_microbatches=BATCH) if dims.get("pp", 1) > 1 else dims  # a micro-batch per sample


def _gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class _Saves(Callback):
    """Saves every ``every`` steps; times each save's hold on the step, each step, and the resident memory."""

    def __init__(self, directory: Path, every: int, saves: int) -> None:
        self.directory, self.every, self.saves = directory, every, saves
        self.saved_at, self.steps, self.rss = [], [], {}  # saved_at: (entered, left) per save
        self._start, self._writing = 0.0, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        flight = trainer.strategy.checkpoints._flight
        self._writing = flight is not None and flight.thread.is_alive()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.steps.append({"step": step, "s": time.perf_counter() - self._start, "during_write": self._writing})
        if step % self.every or len(self.saved_at) >= self.saves:
            return
        if not self.saved_at:
            self.rss["before_first_save"] = rss_bytes()
        entered = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the machine
        trainer.save_checkpoint(self.directory / f"step={step}.ckpt")
        self.saved_at.append((entered, time.perf_counter()))
        if len(self.saved_at) == 2:
            self.rss["after_2_saves"] = rss_bytes()
        sharded.remove(self.directory / f"step={step - 2 * self.every}.ckpt") if trainer.is_global_zero else None

    def on_train_end(self, trainer, pl_module):
        trainer.strategy.checkpoints.finish()
        self.rss[f"after_{len(self.saved_at)}_saves"] = rss_bytes()


def layout_worker(spec: str, asynchronous: bool, every: int, saves: int, directory: str, out: str) -> None:
    dims = _layout(spec)
    pl.seed_everything(0, verbose=False)
    probe = _Saves(Path(directory), every, saves)
    trainer = quiet_trainer(accelerator=accelerator(2), devices=2, callbacks=[probe],
                            strategy=FourDStrategy(**dims, async_save=asynchronous), max_steps=every * saves + 2)
    replicas = dims.get("dp", 1) * dims.get("dp_shard", 1)  # pp_microbatches is no size of the world
    trainer.fit(GPT(**BIG), DataLoader(random_tokens(BATCH * replicas * (every * saves + 2), SEQ, 256),
                                       batch_size=BATCH))
    saved_at = _gathered(probe.saved_at)
    steps, rss = _gathered(probe.steps), _gathered(probe.rss)
    write_rows({"layout": spec, "async": asynchronous, "parameters": sum(p.numel() for p in GPT(**BIG).parameters()),
                # per save: from the last rank's call to the last rank's return, and the longest wait of one rank
                "held_s": [max(left for _, left in ranks) - max(entered for entered, _ in ranks)
                           for ranks in zip(*saved_at)],
                "rank_wait_s": [max(left - entered for entered, left in ranks) for ranks in zip(*saved_at)],
                "steps": [{"step": rows[0]["step"], "s": max(r["s"] for r in rows),
                           "during_write": any(r["during_write"] for r in rows)} for rows in zip(*steps)],
                "rss": rss, "staging_allocations": trainer.strategy.checkpoints.staging.allocations
                if asynchronous else 0}, out)


def scaling_worker(world: int, caching: bool, repeats: int, directory: str, out: str) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner

    if not caching:
        sharded._planner = DefaultSavePlanner  # noqa: SLF001  the comparison's other side
    pl.seed_everything(0, verbose=False)
    result = {}

    class SaveLoad(Callback):
        def on_train_end(self, trainer, pl_module):
            path = Path(directory) / "state.ckpt"
            times = {"save_s": [], "load_s": []}
            for _ in range(repeats):
                for key, action in (("save_s", lambda: trainer.save_checkpoint(path)),
                                    ("load_s", lambda: trainer.strategy.load_checkpoint(path))):
                    dist.barrier()
                    started = time.perf_counter()
                    action()
                    dist.barrier()
                    times[key].append(time.perf_counter() - started)
            result.update({key: min(values) for key, values in times.items()})

    trainer = quiet_trainer(accelerator=accelerator(world), devices=world, callbacks=[SaveLoad()],
                            strategy=FourDStrategy(dp_shard=world, start_method="fork"), max_steps=1)
    trainer.fit(GPT(**SCALING), DataLoader(random_tokens(BATCH * world, SEQ, 256), batch_size=BATCH))
    write_rows({"processes": world, "plan_caching": caching, **result}, out)


def _writers_rank(rank: int, kind: str, megabytes: int, directory: str, port: int, queue) -> None:
    from torch.distributed.checkpoint import async_save
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from lightning_4d.checkpoint import writer as writers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    state = {f"t{i}": torch.randn(megabytes * 2**18 // 16) for i in range(16)}  # fp32: 4 bytes each
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def step() -> float:
        started = time.perf_counter()
        for _ in range(40):
            a.copy_(torch.tanh(a @ b) * 0.5)
        dist.all_reduce(torch.ones(1))  # the ranks step together, as training does
        return time.perf_counter() - started

    if kind == "thread":  # the writer before 2026-12-02: DCP's file writer in the coordinating thread
        from lightning_4d.checkpoint.writer_process import FileSystemWriter, ProcessFileWriter

        ProcessFileWriter.write_data = FileSystemWriter.write_data
    writer = writers.CheckpointWriter(True, rank == 0, lambda decision: False, group=dist.new_group(backend="gloo"))
    stager = DefaultStager(StagingOptions(False, True, False, False))
    baseline = [step() for _ in range(6)][1:]
    blocked, during, durations = [], [], []
    for save in range(3):
        path = Path(directory) / f"{kind}-{save}"
        started = time.perf_counter()
        if kind == "dcp_process":
            future = async_save({"state": state}, checkpoint_id=path, async_stager=stager,
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            done = future.done
        else:
            writer.save({"state_dict": state}, str(path))
            flight = writer._flight  # noqa: SLF001  the benchmark watches the write it started
            done = lambda: not flight.thread.is_alive()  # noqa: E731
        blocked.append(time.perf_counter() - started)
        while True:
            finished = [done()]  # every rank goes on until both writes are done
            everyone = [None, None]
            dist.all_gather_object(everyone, finished[0])
            if all(everyone):
                break
            during.append(step())
        durations.append(time.perf_counter() - started)
        writer.wait() if kind != "dcp_process" else future.result()
    if rank == 0:
        queue.put({"kind": kind, "mb_per_rank": megabytes, "baseline_step_s": statistics.median(baseline),
                   "during_write_step_s": statistics.median(during) if during else None, "steps_during": len(during),
                   "blocked_s": statistics.median(blocked), "write_s": statistics.median(durations)})
    stager.close()
    dist.destroy_process_group()


def writers_kinds(megabytes: int) -> list:
    import multiprocessing

    import socket

    rows = []
    context = multiprocessing.get_context("spawn")
    for kind in ("process", "thread", "dcp_process"):
        queue = context.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            procs = [context.Process(target=_writers_rank, args=(rank, kind, megabytes, tmp, port, queue))
                     for rank in range(2)]
            for proc in procs:
                proc.start()
            row = queue.get(timeout=TIMEOUT_S)
            for proc in procs:
                proc.join(TIMEOUT_S)
        rows.append(row)
        print(row, flush=True)
    return rows


def _summary(row: dict, round_: int) -> dict:
    steps = row["steps"][2:]  # the first steps warm up
    return {"layout": row["layout"], "async": row["async"], "round": round_, "saves": len(row["held_s"]),
            "held_median_s": statistics.median(row["held_s"]), "held_max_s": max(row["held_s"]),
            "rank_wait_median_s": statistics.median(row["rank_wait_s"]),
            "step_median_s": statistics.median(s["s"] for s in steps),
            "steps_during_write": [s["s"] for s in steps if s["during_write"]],
            "rss_gb": {rank: {k: v / 1e9 for k, v in per.items()} for rank, per in enumerate(row["rss"])},
            "staging_allocations": row["staging_allocations"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", nargs="+", default=["dp2", "dp_shard2", "tp2", "pp2"])
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--writers", action="store_true")
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", choices=["layout", "scaling"], default="layout")
    parser.add_argument("--sync-saves", type=int, default=5)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--caching", action="store_true")
    parser.add_argument("--dir", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker and args.mode == "layout":
        layout_worker(args.layouts[0], args.async_save, args.every, args.saves, args.dir, args.out)
        return
    if args.worker:
        scaling_worker(args.worlds[0], args.caching, args.repeats, args.dir, args.out)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.writers:
            rows = writers_kinds(args.mb)
        elif args.scaling:
            for world in args.worlds:
                for caching in (True, False):
                    rows.append(run_worker(__file__, ["--mode", "scaling", "--worlds", str(world), "--repeats",
                                                      str(args.repeats), "--dir", tmp] + ["--caching"] * caching,
                                           TIMEOUT_S))
        else:
            for round_ in range(args.rounds):
                for spec in args.layouts:
                    for asynchronous in (False, True):
                        row = run_worker(__file__, ["--layouts", spec, "--every", str(args.every),
                                                    "--saves", str(args.saves if asynchronous else args.sync_saves),
                                                    "--dir", tmp]
                                         + ["--async-save"] * asynchronous, TIMEOUT_S, env=CPU_MALLOC_ENV)
                        rows.append(_summary(row, round_))
                        print(rows[-1], flush=True)
    name = "async_checkpoint" + ("_writers" if args.writers else "_scaling" if args.scaling else "")
    payload = {"command": command("async_checkpoint.py"), "model": SCALING if args.scaling else BIG,
               "batch_per_replica": BATCH, "seq_len": SEQ, "results": rows}
    print(table(name, payload), f"\n(written to {write(name, payload)})")


if __name__ == "__main__":
    main()
