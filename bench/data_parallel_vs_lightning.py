"""FourDStrategy's data parallelism against Lightning's own strategies: same model, same batches, two processes.

    OMP_NUM_THREADS=1 python bench/data_parallel_vs_lightning.py [--steps 12] [--rounds 3] [--width 256]

Two pairs, each in one launch whose two processes run both strategies of the pair alternately, round by round,
so that neither profits from a quieter moment of this shared machine:

* replicated: ``FourDStrategy(dp=2)`` against ``DDPStrategy()``;
* sharded: ``FourDStrategy(dp_shard=2)`` against ``ModelParallelStrategy(data_parallel_size=2,
  tensor_parallel_size=1)``, whose module applies ``fully_shard`` itself in ``configure_model`` as Lightning's
  documentation shows (each block, then the root, torch's defaults); FourDStrategy shards the unchanged module.

Per run and rank: the median wall time and the median CPU time (this process, ``time.process_time``) of a
training step after 3 warm-up steps, and the peak resident-memory growth above what the process held right
before the model was built (``lightning_4d.observability.telemetry.PeakMemory``; glibc's mmap threshold is fixed so that
freed tensors leave the resident set). A round runs the pair as A B B A and averages each strategy's two runs
(the slower rank of each run), so that a drift of the shared machine's speed cancels. Reported: per pair the
ratio FourD / Lightning of each figure in every round, its minimum, median and maximum; the result goes to
``bench/results/data_parallel_vs_lightning.json`` and, with matplotlib, its plot to the ``.png`` beside it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CPU_MALLOC_ENV  # noqa: E402

if any(os.environ.get(key) != value for key, value in CPU_MALLOC_ENV.items()):  # before torch allocates anything
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CPU_MALLOC_ENV})

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CpuStepTimer, command, plot_if_possible, quiet_trainer, random_tokens,  # noqa: E402
                          write)
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d.observability.telemetry import PeakMemory  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, block_size=128)
BATCH, SEQ = 8, 128  # per process


class FullyShardedGPT(GPT):
    """The example GPT as a ModelParallelStrategy user writes it: FSDP2 applied in ``configure_model``."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


PAIRS = {
    "replicated": {"Lightning DDPStrategy": (GPT, DDPStrategy),
                   "FourDStrategy(dp=2)": (GPT, lambda: FourDStrategy(dp=2))},
    "sharded": {"Lightning ModelParallelStrategy(data_parallel_size=2)": (
        FullyShardedGPT, lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)),
        "FourDStrategy(dp_shard=2)": (GPT, lambda: FourDStrategy(dp_shard=2))},
}


class _PeakGrowth(Callback):
    def __init__(self, memory: PeakMemory) -> None:
        self.memory = memory
        self.growth = 0.0

    def on_train_end(self, trainer, pl_module):
        self.growth = self.memory.growth()


def run(module_class, make_strategy, steps: int, width: int) -> dict:
    """One Trainer; returns this rank's median step wall time, CPU time and peak memory growth."""
    gc.collect()
    memory = PeakMemory(torch.device("cpu"))
    pl.seed_everything(0, verbose=False)
    memory.start()
    model = module_class(n_embd=width, **MODEL)
    timer, peak = CpuStepTimer(), _PeakGrowth(memory)
    trainer = quiet_trainer(accelerator="cpu", devices=2, strategy=make_strategy(), max_steps=steps,
                            callbacks=[timer, peak])
    trainer.fit(model, DataLoader(random_tokens(2 * BATCH * steps, SEQ, MODEL["vocab_size"]), batch_size=BATCH))
    mine = {"wall_s": timer.median, "cpu_s": statistics.median(timer.cpu), "peak_mib": peak.growth / 2**20}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {key: max(rank[key] for rank in everyone) for key in mine}  # the slower (larger) rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    args = parser.parse_args()
    results = {}
    for pair in args.pairs:
        runs = {name: [] for name in PAIRS[pair]}
        for round_ in range(args.rounds):
            # A round runs A B B A (B A A B every other round: the first run of a process pays one-time costs)
            # and takes each strategy's mean: a machine that speeds up or slows down during the round weighs
            # on both alike.
            order = list(PAIRS[pair].items())
            first, second = order if round_ % 2 == 0 else order[::-1]
            figures = {name: [] for name in PAIRS[pair]}
            for name, (module_class, make_strategy) in (first, second, second, first):
                figures[name].append(run(module_class, make_strategy, args.steps, args.width))
            for name, pair_runs in figures.items():
                runs[name].append({key: statistics.mean(r[key] for r in pair_runs) for key in pair_runs[0]})
        lightning, fourd = runs.values()
        ratios = {key: [f[key] / l[key] for f, l in zip(fourd, lightning)] for key in ("wall_s", "cpu_s", "peak_mib")}
        results[pair] = {"runs": runs, "fourd_over_lightning": {
            key: {"per_round": values, "min": min(values), "median": statistics.median(values), "max": max(values)}
            for key, values in ratios.items()}}
    if dist.get_rank() != 0:
        return
    print("| pair | figure | Lightning (median of rounds) | FourD (median of rounds) | FourD / Lightning per round |"
          " median ratio |")
    print("|---|---|---|---|---|---|")
    for pair, result in results.items():
        (lightning_name, lightning), (fourd_name, fourd) = result["runs"].items()
        for key, unit in (("wall_s", "s/step"), ("cpu_s", "CPU s/step"), ("peak_mib", "MiB peak")):
            ratio = result["fourd_over_lightning"][key]
            print(f"| {pair} | {unit} | {statistics.median(r[key] for r in lightning):.3f} |"
                  f" {statistics.median(r[key] for r in fourd):.3f} |"
                  f" {', '.join(f'{v:.2f}' for v in ratio['per_round'])} | {ratio['median']:.2f} |")
    payload = {"command": command("data_parallel_vs_lightning.py"), "model": dict(MODEL, n_embd=args.width),
               "batch_per_process": BATCH, "seq_len": SEQ, "steps": args.steps, "rounds": args.rounds,
               "results": results}
    path = write("data_parallel_vs_lightning", payload)
    drawn = plot_if_possible("data_parallel_vs_lightning", payload)
    print(f"(written to {path}{f' and {drawn}' if drawn else ''})")


if __name__ == "__main__":
    main()
