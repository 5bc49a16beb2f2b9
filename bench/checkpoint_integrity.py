"""What checkpoint verification costs when loading: the checksum pass against the load itself.

    OMP_NUM_THREADS=1 python bench/checkpoint_integrity.py [--mb 200] [--repeats 3]

One process saves a model of ``--mb`` megabytes of float32 weights (plus AdamW state, so about three times
that on disk) with ``lightning_4d.checkpoint.save``, then times, best of ``--repeats`` (the files are in the
page cache after the first read, as they are when a job resumes from a checkpoint it just wrote):

* ``verify``: the checksum pass alone (size and CRC-32 of every file, what the loader runs first);
* ``load``: ``checkpoint.load`` (verification, then DCP's load into the model and optimizer);
* ``load unverified``: the same load with the verification skipped.

``load - load unverified`` should equal ``verify`` (no other cost).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_4d import checkpoint  # noqa: E402
from lightning_4d.checkpoint import sharded  # noqa: E402


def _model(mb: float) -> nn.Module:
    width = 1024
    layers = max(1, int(mb * 2**20 / 4 / (width * width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = _model(args.mb)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.ckpt"
        state = {"state_dict": checkpoint.model_state(model),
                 "optimizer_states": [checkpoint.optimizer_state(model, optimizer)]}
        checkpoint.save(state, path, is_writer=True)
        size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
        verify = _best(lambda: checkpoint.verify(path), args.repeats)
        load = _best(lambda: checkpoint.load(path, model, [optimizer]), args.repeats)
        unverified = _best(lambda: sharded._load_shards(path, model, [optimizer], True, None, verified=True),
                           args.repeats)
    print(f"checkpoint {size:.0f} MiB on disk; best of {args.repeats}:")
    print(f"  verify (checksum pass)   {verify:7.3f} s  ({size / verify:.0f} MiB/s)")
    print(f"  load                     {load:7.3f} s")
    print(f"  load unverified          {unverified:7.3f} s")
    print(f"  load - load unverified   {load - unverified:7.3f} s")


if __name__ == "__main__":
    main()
