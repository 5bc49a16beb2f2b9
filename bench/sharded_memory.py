"""Model state per rank (parameters + gradients + AdamW state) under sharded vs replicated data parallelism.

    OMP_NUM_THREADS=1 python bench/sharded_memory.py [--layouts single dp2 dp_shard2 dp4 dp_shard4 hsdp2x2]
                                                     [--width 256] [--steps 2]

The example GPT (8 layers, 8 heads, vocabulary 256, ``--width`` n_embd) trains ``--steps`` steps of a global
batch of 8 sequences of 64 tokens (AdamW, fp32) under each layout; layouts with the same process count share
one launch. After the last optimizer step every rank counts the bytes of the tensors it holds: its parameters
(local shards), their gradients and the optimizer's state tensors. These are exact byte counts of live
tensors, not a process's resident set (activations, communication buffers and the allocator are left out).
The figure is the largest rank's, and the ratio is against one process.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (command, plot_if_possible, quiet_trainer, random_tokens, run_worker, write,  # noqa: E402
                          write_rows)
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=8, n_head=8, block_size=64)
GLOBAL_BATCH, SEQ = 8, 64
TIMEOUT_S = 900
LAYOUTS = {"single": {}, "dp2": {"dp": 2}, "dp_shard2": {"dp_shard": 2}, "dp4": {"dp": 4},
           "dp_shard4": {"dp_shard": 4}, "hsdp2x2": {"dp": 2, "dp_shard": 2}}


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class _StateBytes(Callback):
    """Every rank's parameter, gradient and optimizer-state bytes after the last optimizer step."""

    def __init__(self) -> None:
        self.ranks: list[dict] = []

    def on_train_end(self, trainer, pl_module):
        params = list(pl_module.parameters())
        optimizer = trainer.optimizers[0]
        mine = {"params": sum(_bytes(p) for p in params),
                "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(_bytes(v) for state in optimizer.state.values() for v in state.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)}
        self.ranks = [mine]
        if dist.is_initialized():
            self.ranks = [None] * trainer.world_size
            dist.all_gather_object(self.ranks, mine)


def measure(width: int, spec: str, steps: int, processes: int) -> dict:
    pl.seed_everything(0, verbose=False)
    model = GPT(n_embd=width, **MODEL)
    # Lightning sets gradients to None before each step's backward, not after the optimizer step: they are
    # still there at on_train_end, as they are at the peak of a step.
    probe = _StateBytes()
    strategy = FourDStrategy(**LAYOUTS[spec])
    trainer = quiet_trainer(accelerator="cpu", devices=processes, strategy=strategy, max_steps=steps,
                            callbacks=[probe])
    replicas = LAYOUTS[spec].get("dp", 1) * LAYOUTS[spec].get("dp_shard", 1)
    trainer.fit(model, DataLoader(random_tokens(GLOBAL_BATCH * steps, SEQ, MODEL["vocab_size"]),
                                  batch_size=GLOBAL_BATCH // replicas))
    heaviest = max(probe.ranks, key=lambda r: sum(r.values()))
    count = sum(p.numel() for p in GPT(n_embd=width, **MODEL).parameters())
    return {"layout": spec, "processes": processes, "params": count, "per_rank_mib": {k: v / 2**20 for k, v in heaviest.items()},
            "total_mib": sum(heaviest.values()) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        write_rows([measure(args.width, spec, args.steps, args.processes) for spec in args.layouts], args.out)
        return
    groups: dict[int, list[str]] = {}
    for spec in args.layouts:
        count = LAYOUTS[spec].get("dp", 1) * LAYOUTS[spec].get("dp_shard", 1)
        groups.setdefault(count, []).append(spec)
    rows = []
    for count, specs in groups.items():
        rows += run_worker(__file__, ["--layouts", *specs, "--processes", str(count), "--width", str(args.width),
                                      "--steps", str(args.steps)], TIMEOUT_S)
    single = next((row["total_mib"] for row in rows if row["layout"] == "single"), None)
    print("| layout | processes | params MiB | grads MiB | AdamW state MiB | total MiB per rank | vs one process |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['total_mib'] / single:.3f}" if single else "-"
        part = row["per_rank_mib"]
        print(f"| {row['layout']} | {row['processes']} | {part['params']:.2f} | {part['grads']:.2f} |"
              f" {part['optimizer']:.2f} | {row['total_mib']:.2f} | {ratio} |")
    payload = {"command": command("sharded_memory.py"), "model": dict(MODEL, n_embd=args.width),
               "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "steps": args.steps, "results": rows}
    path = write("sharded_memory", payload)
    drawn = plot_if_possible("sharded_memory", payload)
    print(f"(written to {path}{f' and {drawn}' if drawn else ''})")


if __name__ == "__main__":
    main()
