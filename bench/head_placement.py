"""Where the fused LM head forms its gradients: in the forward (the default) or in the backward (GPipe's last stage).

    OMP_NUM_THREADS=1 python bench/head_placement.py [--sizes 512x128x256 1024x256x32000] [--iters 50] [--rounds 3]

One process, one micro-batch's LM head and cross entropy (``tokens x hidden`` rows, a ``vocabulary x hidden``
head weight, fp32): unfused (the logits whole, then ``F.cross_entropy``), fused with the gradients formed in the
forward, and fused with them formed in the backward from each chunk's logits computed again
(:mod:`lightning_4d.numerics.chunked_cross_entropy`). Per variant, the median CPU time of a forward alone and of
a forward with its backward (blocks of ``--iters`` calls, the variants taking turns for ``--rounds`` rounds),
and the bytes of the tensors the forward made that are still held when it returns (what waits for the backward,
inputs and the loss aside): for a pipeline schedule that runs every micro-batch's forward before any backward
(GPipe), that is held once per micro-batch. The first size is the last stage of ``bench/pp.py``'s micro-batch;
the second a vocabulary of 32,000.
"""

import argparse
import gc
import os
import statistics
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import command, write  # noqa: E402
from lightning_4d.numerics import head_loss  # noqa: E402

VARIANTS = ("unfused", "gradients_in_forward", "gradients_in_backward")


class MadeTensors(TorchDispatchMode):
    """Weak references to the tensors the ops inside it make."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        return out


class _Case:
    def __init__(self, tokens: int, hidden: int, vocab: int) -> None:
        torch.manual_seed(0)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.rows = torch.randn(tokens, hidden)
        self.target = torch.randint(0, vocab, (tokens,))
        self.fused = head_loss.ChunkedHeadLoss("head", self.head)

    def loss(self, variant: str, rows: torch.Tensor) -> torch.Tensor:
        vocab = self.head.out_features
        if variant == "unfused":
            return F.cross_entropy(nn.Linear.forward(self.head, rows).view(-1, vocab), self.target)
        self.fused.gradients_in_backward = variant == "gradients_in_backward"
        with head_loss.step_scope(self.fused):
            return F.cross_entropy(self.head(rows).view(-1, vocab), self.target)

    def step(self, variant: str, backward: bool) -> None:
        loss = self.loss(variant, self.rows.detach().requires_grad_())
        if backward:
            loss.backward()
        self.head.weight.grad = None

    def held_bytes(self, variant: str) -> int:
        rows = self.rows.detach().requires_grad_()
        with MadeTensors() as probe:
            loss = self.loss(variant, rows)
        gc.collect()
        inputs = {rows.untyped_storage().data_ptr(), self.target.untyped_storage().data_ptr()}
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in probe.made)
                if t is not None and t is not loss and t.untyped_storage().data_ptr() not in inputs}
        del loss
        return sum(held.values())


def _cpu_ms(case: _Case, variant: str, backward: bool, iters: int) -> float:
    start = time.process_time()
    for _ in range(iters):
        case.step(variant, backward)
    return (time.process_time() - start) / iters * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["512x128x256", "1024x256x32000"],
                        help="tokens x hidden x vocabulary")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        tokens, hidden, vocab = map(int, size.split("x"))
        case = _Case(tokens, hidden, vocab)
        iters = max(1, args.iters * 512 * 256 // (tokens * vocab))  # about the same time per block at any size
        times: dict[tuple[str, bool], list[float]] = {}
        for variant in VARIANTS:  # warm-up
            case.step(variant, True)
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
            for backward in (False, True):
                for variant in order:
                    times.setdefault((variant, backward), []).append(_cpu_ms(case, variant, backward, iters))
        for variant in VARIANTS:
            rows.append({"tokens": tokens, "hidden": hidden, "vocab": vocab, "variant": variant,
                         "forward_cpu_ms": statistics.median(times[variant, False]),
                         "forward_backward_cpu_ms": statistics.median(times[variant, True]),
                         "forward_cpu_ms_rounds": times[variant, False],
                         "forward_backward_cpu_ms_rounds": times[variant, True],
                         "held_after_forward_mib": case.held_bytes(variant) / 2**20, "iters": iters})
    payload = {"command": command("head_placement.py"), "rounds": args.rounds, "results": rows}
    print("| tokens x hidden x vocabulary | variant | forward, ms CPU | forward + backward, ms CPU |"
          " held from forward to backward, MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} x {r['hidden']} x {r['vocab']} | {r['variant']} | {r['forward_cpu_ms']:.2f} |"
              f" {r['forward_backward_cpu_ms']:.2f} | {r['held_after_forward_mib']:.2f} |")
    print(f"(written to {write('head_placement', payload)})")


if __name__ == "__main__":
    main()
