"""Distributed checkpoint: save and load time, and the bytes each rank writes, at a 4D layout against one
process.

    OMP_NUM_THREADS=1 python bench/checkpoint.py [--layout dp2pp2tp2] [--steps 3] [--repeats 3]

The example GPT (8 layers, n_embd 256, 8 heads, vocabulary 256: 6.4M parameters, whose weights and AdamW
state make a checkpoint of about 77 MB) trains ``--steps`` steps under ``FourDStrategy`` with the ``--layout``
and, in a second launch, on one process. When training ends each run saves with ``trainer.save_checkpoint``
(a DCP directory written as ``.partial`` and renamed) and loads it back into the model and optimizer with
``trainer.strategy.load_checkpoint``, which is what ``fit(ckpt_path=...)`` calls; each is timed between
barriers (the slowest rank), best of ``--repeats``. The one-process run also loads the 4D checkpoint, which
reshards it into the unsharded module. Bytes per rank are the sizes of the ``__<rank>_0.distcp`` files DCP
writes; rank 0 also writes the index (``.metadata``) and Lightning's loop state (``meta.pt``).
"""

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (accelerator, command, layout, processes, quiet_trainer, random_tokens,  # noqa: E402
                          run_worker, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=8, n_head=8, n_embd=256, block_size=128)
BATCH, SEQ = 8, 128  # per replica
TIMEOUT_S = 900


def _timed(action) -> float:
    """Seconds from every rank starting ``action`` to every rank finishing it."""
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    action()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


class _SaveLoad(Callback):
    """Saves and loads when training ends, while the sharded model and optimizer are still set up."""

    def __init__(self, path: Path, repeats: int, reshard_from: str) -> None:
        self.path, self.repeats, self.reshard_from = path, repeats, reshard_from
        self.result: dict = {}

    def on_train_end(self, trainer, pl_module):
        save = [_timed(lambda: trainer.save_checkpoint(self.path)) for _ in range(self.repeats)]
        load = [_timed(lambda: trainer.strategy.load_checkpoint(self.path)) for _ in range(self.repeats)]
        sizes = {f.name: f.stat().st_size for f in self.path.iterdir()}
        ranks = {int(m[1]): size for name, size in sizes.items() if (m := re.fullmatch(r"__(\d+)_0\.distcp", name))}
        self.result = {"save_s": min(save), "load_s": min(load),
                       "distcp_bytes_per_rank": [ranks.get(rank, 0) for rank in range(trainer.world_size)],
                       "index_and_meta_bytes": sum(sizes.values()) - sum(ranks.values())}
        if self.reshard_from:
            self.result["load_other_layout_s"] = min(
                _timed(lambda: trainer.strategy.load_checkpoint(self.reshard_from)) for _ in range(self.repeats))


def worker(spec: str, steps: int, repeats: int, directory: str, reshard_from: str, out: str) -> None:
    count = processes(spec)
    dims = layout(spec)
    pl.seed_everything(0, verbose=False)
    saver = _SaveLoad(Path(directory) / "checkpoint", repeats, reshard_from)
    trainer = quiet_trainer(accelerator=accelerator(count), devices=count, strategy=FourDStrategy(**dims),
                            max_steps=steps, callbacks=[saver])
    data = random_tokens(BATCH * dims.get("dp", 1) * steps, SEQ, MODEL["vocab_size"])
    trainer.fit(GPT(**MODEL), DataLoader(data, batch_size=BATCH))
    write_rows({"layout": spec, "processes": count, **saver.result}, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="dp2pp2tp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--dir", default="")
    parser.add_argument("--reshard-from", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.layout, args.steps, args.repeats, args.dir, args.reshard_from, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        both = ["--steps", str(args.steps), "--repeats", str(args.repeats)]
        sharded = run_worker(__file__, ["--layout", args.layout, "--dir", f"{tmp}/sharded", *both], TIMEOUT_S)
        single = run_worker(__file__, ["--layout", "single", "--dir", f"{tmp}/single",
                                       "--reshard-from", f"{tmp}/sharded/checkpoint", *both], TIMEOUT_S)
    whole = sum(single["distcp_bytes_per_rank"])
    for row in (single, sharded):
        row["max_rank_bytes"] = max(row["distcp_bytes_per_rank"])
        row["total_bytes"] = sum(row["distcp_bytes_per_rank"])
        row["max_rank_vs_single"] = row["max_rank_bytes"] / whole
    payload = {"command": command("checkpoint.py"), "model": MODEL, "batch_per_replica": BATCH, "seq_len": SEQ,
               "steps": args.steps, "repeats": args.repeats, "accelerator": accelerator(processes(args.layout)),
               "results": [single, sharded]}
    print(table("checkpoint", payload), f"\n(written to {write('checkpoint', payload)})")


if __name__ == "__main__":
    main()
