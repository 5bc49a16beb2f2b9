"""What the always-on collective recorder (``lightning_4d.faults.recorder``) costs per collective.

    OMP_NUM_THREADS=1 python bench/recorder.py [--world 2] [--calls 2000] [--rounds 5]

``--world`` processes on gloo issue ``--calls`` all-reduces, of 4 floats (where the per-call overhead shows
most) and of 1M floats (a 4 MB gradient bucket), alternately without and with the recorder installed,
``--rounds`` times each; the best round of each is reported, per call, with the difference. ``--world 1``
isolates the recorder's own cost (no waiting on a peer, whose jitter on a loaded machine is larger).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _per_call(tensor: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor)
    return (time.perf_counter() - start) / calls


def _worker(rank: int, world: int, port: int, calls: int, rounds: int, out: str) -> None:
    from lightning_4d.faults import recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for numel in (4, 1 << 20):
        tensor = torch.ones(numel)
        _per_call(tensor, calls // 10)  # warm-up
        best = {"off": float("inf"), "on": float("inf")}
        for _ in range(rounds):
            for state in ("off", "on"):
                (recorder.install if state == "on" else recorder.uninstall)()
                best[state] = min(best[state], _per_call(tensor, calls if numel == 4 else calls // 20))
        recorder.uninstall()
        results[numel] = best
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from tests.parity import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "recorder.json")
        mp.spawn(_worker, args=(args.world, free_port(), args.calls, args.rounds, out), nprocs=args.world)
        with open(out) as file:
            results = json.load(file)
    print(f"all_reduce on {args.world} gloo process(es), best of {args.rounds} rounds, per call:")
    for numel, best in results.items():
        print(f"  {int(numel):>8} floats: without {best['off'] * 1e6:8.1f} us, with the recorder"
              f" {best['on'] * 1e6:8.1f} us, difference {(best['on'] - best['off']) * 1e6:+6.1f} us")


if __name__ == "__main__":
    main()
