"""What watching for token-mean losses costs a step's forward, per mechanism, in one process.

    OMP_NUM_THREADS=1 python bench/token_watch.py [--iters 100] [--rounds 3]

The example GPT (4 blocks, n_embd 128, vocabulary 256; 4 x 128 tokens, the pp bench's last stage on one
micro-batch) runs its forward and cross entropy: without watching (``none``), inside ``TokenMeanLosses``
(``tokens``: the loss calls are caught at torch's loss entries, :mod:`lightning_4d.numerics.token_losses`), and
inside a torch-function mode that only passes every call on (``function_mode``: what the watcher's former
mechanism cost per op before doing anything). Median wall and CPU time per forward over a block of ``--iters``
forwards of each, the blocks alternating for ``--rounds`` rounds, each round starting with another;
``cross_entropy_only`` times the loss call alone, unwatched and watched. It also counts the torch calls of one
forward that a torch-function mode intercepts (each one a Python call before the op); the watcher intercepts the
loss call only.
"""

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from bench.common import command, write  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d.numerics.token_losses import TokenMeanLosses  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 4, 128


class _PassOn(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


WATCHERS = {"none": nullcontext, "tokens": lambda: TokenMeanLosses(None), "function_mode": _PassOn}


def _timed(run, iters: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``iters`` calls of ``run`` in a row (a block: taking turns call by call, a
    forward's time depends by up to 1.5 ms on which variant ran just before)."""
    walls, cpus = [], []
    for _ in range(iters):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(**MODEL).model
    x, y = torch.randint(0, MODEL["vocab_size"], (2, BATCH, SEQ))
    logits = torch.randn(BATCH * SEQ, MODEL["vocab_size"], requires_grad=True)

    def forward(watcher):
        with watcher():
            F.cross_entropy(model(x).reshape(-1, MODEL["vocab_size"]), y.reshape(-1))

    def loss_only(watcher):
        with watcher():
            F.cross_entropy(logits, y.reshape(-1))

    rows = []
    for round_ in range(args.rounds):
        for what, run, names, iters in (("forward", forward, list(WATCHERS), args.iters),
                                        ("cross_entropy_only", loss_only, ["none", "tokens"], args.iters * 5)):
            names = names[round_ % len(names):] + names[:round_ % len(names)]  # each round starts with another
            for name in names:
                wall, cpu = _timed(lambda: run(WATCHERS[name]), iters)
                rows.append({"round": round_, "what": what, "watcher": name, "wall_ms": wall * 1e3,
                             "cpu_ms": cpu * 1e3})
    counting = _PassOn()
    forward(lambda: counting)
    print(f"torch calls a torch-function mode intercepts in one forward: {counting.calls}; token-mean loss calls the"
          " watcher intercepts: 1")
    print("| round | what | watcher | wall (ms) | CPU (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['what']} | {r['watcher']} | {r['wall_ms']:.3f} | {r['cpu_ms']:.3f} |")
    path = write("token_watch", {"command": command("token_watch.py"), "model": MODEL, "batch": BATCH, "seq_len": SEQ,
                                 "iters": args.iters,
                                 "calls_a_function_mode_intercepts_per_forward": counting.calls, "results": rows})
    print(f"(written to {path})")


if __name__ == "__main__":
    main()
