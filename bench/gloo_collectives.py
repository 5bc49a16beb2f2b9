"""Whether 2 ranks on gloo survive many steps of expert parallelism's collectives, through torch's functional
collectives and through the path lightning-4d takes on the CPU (c10d's, ``lightning_4d._compat``).

    OMP_NUM_THREADS=1 python bench/gloo_collectives.py [--runs 6] [--steps 4000] [--layers 4]
                                                       [--paths functional,lightning_4d]

Each step is what :class:`~lightning_4d.expert_parallel.dispatch.GatheredDispatch` does around each of
``--layers`` layers, on tiny tensors: a differentiable all-gather of the hidden states, an all-gather of the
routing, a differentiable reduce-scatter of the combined outputs; then the backward (a reduce-scatter and an
all-gather per layer) while a gradient bucket's all-reduce is in flight. Every run is a fresh pair of
processes; a run fails when a rank exits non-zero or does not finish in time. Reported per path: failed runs out
of ``--runs``, and the first line each failure's ranks printed about the heap or a signal ("malloc(): unaligned
tcache chunk detected", "free(): invalid pointer", a segmentation fault).
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAP = re.compile(r"(malloc\(\).*|free\(\).*|double free.*|corrupted.*|Segmentation fault|Fatal Python error: \w+)")


def _step_collectives(path: str):
    """(differentiable all-gather, all-gather, differentiable reduce-scatter) for ``path``."""
    from lightning_4d import _compat as compat
    if path == "functional":
        functional = compat.functional_collectives()
        return (lambda x, g: functional.all_gather_tensor_autograd(x, 0, g),
                lambda x, g: functional.all_gather_tensor(x, 0, g),
                lambda x, g: functional.reduce_scatter_tensor_autograd(x, "sum", 0, g))
    return (lambda x, g: compat.all_gather_in_stream(x, g, differentiable=True),
            lambda x, g: compat.all_gather_in_stream(x, g),
            compat.reduce_scatter_in_stream)


def _rank(path: str, steps: int, layers: int) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crashed rank names its signal
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    gather_grad, gather, scatter_grad = _step_collectives(path)
    torch.manual_seed(rank)
    weight = torch.randn(32, 32, requires_grad=True)
    bucket = torch.zeros(5000)
    for _ in range(steps):
        hidden = torch.randn(64, 32) @ weight
        for _ in range(layers):
            everyone = gather_grad(hidden.contiguous(), group)
            chosen = gather(torch.randint(0, 4, (64, 2)), group)
            hidden = scatter_grad(everyone * 2 + chosen.float().sum(1, keepdim=True), group) + hidden
        loss = hidden.square().mean()
        work = dist.all_reduce(bucket, async_op=True)
        loss.backward()
        work.wait()
        weight.grad = None
    print(f"rank {rank}: {steps} steps", flush=True)
    os._exit(0)  # the run is over; what interpreter exit does to gloo's threads is not what this measures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path: str, steps: int, layers: int, timeout: float) -> tuple[bool, str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, __file__, "--rank-of", path, "--steps", str(steps), "--layers", str(layers)]
    ranks = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    deadline, outputs, ok = time.monotonic() + timeout, [], True
    for process in ranks:
        try:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            process.kill()
            outputs.append(process.communicate()[0] + "\n(timed out)")
        ok = ok and process.returncode == 0
    found = [m.group(0) for out in outputs for m in [HEAP.search(out)] if m]
    codes = [process.returncode for process in ranks]
    return ok, "" if ok else f"exit codes {codes}" + (f": {found[0]}" if found else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--paths", default="functional,lightning_4d")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        _rank(args.rank_of, args.steps, args.layers)
        return
    import torch
    results = {"torch": torch.__version__, "runs": args.runs, "steps": args.steps, "layers": args.layers}
    for path in args.paths.split(","):
        failures = []
        start = time.monotonic()
        for _ in range(args.runs):
            ok, why = _run(path, args.steps, args.layers, args.timeout)
            if not ok:
                failures.append(why)
        results[path] = {"failed": len(failures), "why": failures, "wall_s": round(time.monotonic() - start, 1)}
        print(f"{path}: {len(failures)} of {args.runs} runs failed {failures}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
