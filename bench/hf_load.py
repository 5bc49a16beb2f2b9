"""What each rank reads and holds while loading pretrained weights at tp=2 (a measurement, not a test).

    OMP_NUM_THREADS=1 python bench/hf_load.py [--hidden 768 --layers 15 --vocab 32000] [--dir /tmp/hf_load]

A Hugging Face Llama (defaults: 156M parameters, 0.62 GB in fp32) is saved once with ``save_pretrained``
(sharded safetensors with an index) and as a plain ``state_dict`` file. Then, for each way of loading, two
fresh processes (gloo, tp=2) build the model on the meta device, shard it over tp with torch's own
``parallelize_module`` (Llama's usual plan: q/k/v/gate/up by rows, o/down by columns, embedding and head by
rows; norms replicated), allocate only their shards (``to_empty``), and load:

- ``hf``: ``lightning_4d.checkpoint.load_weights(hf_dir)`` (DCP's ``HuggingFaceStorageReader``, each rank's slices);
- ``mmap``: ``load_weights(state_dict_file)`` (``torch.load(mmap=True)``, each rank copies its own part);
- ``torch.load``: what ``init_from`` did before: ``torch.load`` of the whole file on each rank, then each rank
  takes its own part.

Per rank, with its shards already resident (zeroed) before the load: the peak resident memory during the load
above the memory before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), split (sampled
every 2 ms) into anonymous memory (allocations) and file-backed pages (bytes read through a memory map: they
stay in the page cache and are counted while mapped), and the bytes read with ``read()`` (``rchar``). Page-cache
state is not controlled: the files were just written, so these are bytes touched, not disk traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RssSampler, llama_config, proc_status, save_llama  # noqa: E402

MODES = ("hf", "mmap", "torch.load")


def _status() -> dict[str, int]:
    return proc_status("VmRSS", "VmHWM", "RssAnon", "RssFile", "rchar")


def _config(args):
    return llama_config(args.hidden, args.layers, args.vocab, heads=args.heads, intermediate=args.intermediate)


def _rank(args, root: Path) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_4d import checkpoint

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config(args))
    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
    for i in range(args.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    with torch.no_grad():  # the shards resident before the load, so that what the load adds is measured alone
        for value in model.state_dict().values():
            (value.to_local() if isinstance(value, DTensor) else value).zero_()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _status()
    with RssSampler() as sampler:
        start = time.perf_counter()
        if args.mode == "hf":
            checkpoint.load_weights(root / "hf", model)
        elif args.mode == "mmap":
            checkpoint.load_weights(root / "state_dict.pt", model)
        else:
            full = torch.load(root / "state_dict.pt", map_location="cpu", weights_only=True)
            with torch.no_grad():
                for key, target in model.state_dict().items():
                    if isinstance(target, DTensor):
                        part = distribute_tensor(full[key], target.device_mesh, target.placements,
                                                 src_data_rank=None)
                        target.to_local().copy_(part.to_local())
                    else:
                        target.copy_(full[key])
            del full
        seconds = time.perf_counter() - start
    peaks = sampler.peaks
    after = _status()
    held = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * 4 for t in model.state_dict().values())
    # check the values: this rank's part of a few tensors against the file
    reference = torch.load(root / "state_dict.pt", map_location="cpu", weights_only=True, mmap=True)
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.weight"):
        value = model.state_dict()[key]
        expected = distribute_tensor(reference[key], value.device_mesh, value.placements, src_data_rank=None)
        assert torch.equal(value.to_local(), expected.to_local()), key
    result = {"rank": dist.get_rank(), "mode": args.mode, "seconds": round(seconds, 3), "shard_bytes": held,
              "peak_above_before": after["VmHWM"] - before["VmRSS"],
              "anon_peak_above": peaks["RssAnon"] - before["RssAnon"],
              "file_peak_above": peaks["RssFile"] - before["RssFile"], "rchar": after["rchar"] - before["rchar"]}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", default="/tmp/lightning_4d_hf_load")
    parser.add_argument("--mode", choices=MODES)  # set for the ranks
    args = parser.parse_args()
    root = Path(args.dir)
    if args.mode:
        _rank(args, root)
        return
    save_llama(_config(args), root, max_shard_size="200MB")
    model_bytes = (root / "state_dict.pt").stat().st_size
    print(f"model: {model_bytes / 1e9:.3f} GB in fp32 ({root})")
    print(f"{'mode':<11} {'rank':>4} {'seconds':>8} {'shard GB':>9} {'peak RSS +GB':>13} {'anon +GB':>9}"
          f" {'mapped file +GB':>16} {'read() GB':>10}")
    for mode in MODES:
        port = _free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                       LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--mode", mode], env=env,
                                          stdout=subprocess.PIPE, text=True))
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
                    print(f"{mode:<11} {r['rank']:>4} {r['seconds']:>8.2f} {r['shard_bytes'] / 1e9:>9.3f}"
                          f" {r['peak_above_before'] / 1e9:>13.3f} {r['anon_peak_above'] / 1e9:>9.3f}"
                          f" {r['file_peak_above'] / 1e9:>16.3f} {r['rchar'] / 1e9:>10.3f}")


if __name__ == "__main__":
    main()
