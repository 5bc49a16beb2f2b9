"""Peak resident memory per rank of FourDStrategy's setup, whole-built vs meta-built (issue #27).

    python bench/meta_init_memory.py                      # every layout, results printed and in bench/results/
    python bench/meta_init_memory.py --hidden 512 --layers 4   # a smaller model

A Hugging Face Llama (default: hidden 1024, 8 layers, vocabulary 8192: 151M parameters, 0.60 GB fp32) is built
whole on every rank, or on the meta device (``trainer.init_module(empty_init=True)`` in ``configure_model``),
and set up under tp=2 and dp_shard=2 on 2 CPU processes (and one process whole-built, for scale). Each rank
records its resident memory before the model is built and its peak (``ru_maxrss``) when training starts, that
is after construction, parallelization, materialization, initialization and the optimizer (SGD without momentum:
no state). Not a timed test: a measurement, run by hand.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYOUTS = {"one process": ({}, 1), "tp=2": ({"tp": 2}, 2), "dp_shard=2": ({"dp_shard": 2}, 2)}


def _run(args: argparse.Namespace) -> None:
    """One layout (this process is one of its ranks; Lightning starts the others with the same argv)."""
    import lightning.pytorch as pl
    import torch
    import transformers
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from bench.common import llama_config, rss_bytes
    from lightning_4d import FourDStrategy

    before = rss_bytes()
    config = llama_config(args.hidden, args.layers, args.vocab)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None if args.meta else transformers.LlamaForCausalLM(config)

        def configure_model(self):
            if self.model is None:
                with self.trainer.init_module(empty_init=True):
                    self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            input_ids, labels = batch
            return self.model(input_ids=input_ids, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in pl_module.parameters())
            Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(
                {"before": before, "peak": peak, "held_bytes": local}))

    strategy, devices = LAYOUTS[args.layout]
    tokens = torch.randint(0, args.vocab, (8, 33), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
                         strategy=FourDStrategy(**strategy, tp_self_check=False) if devices > 1 else "auto")
    trainer.fit(Model(), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layout", choices=list(LAYOUTS))
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.layout is not None:
        _run(args)
        return
    params = args.layers * 16 * args.hidden ** 2 + 2 * args.vocab * args.hidden + (2 * args.layers + 1) * args.hidden
    model_gb = params * 4 / 1e9
    print(f"Llama: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}: {params / 1e6:.0f}M"
          f" parameters, {model_gb:.2f} GB fp32")
    print("| layout | build | rank | before build (GB) | peak at train start (GB) | peak - before (GB) |"
          " (peak - before) / model | held parameters (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for layout, (_, devices) in LAYOUTS.items():
        for meta in (False, True) if devices > 1 else (False,):
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, __file__, "--layout", layout, "--out", out, "--hidden", str(args.hidden),
                           "--layers", str(args.layers), "--vocab", str(args.vocab)] + (["--meta"] if meta else [])
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
                subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                for rank in range(devices):
                    r = json.loads(Path(out, f"rank{rank}.json").read_text())
                    grown = (r["peak"] - r["before"]) / 1e9
                    rows.append(dict(layout=layout, meta=meta, rank=rank, **r))
                    print(f"| {layout} | {'meta' if meta else 'whole'} | {rank} | {r['before'] / 1e9:.2f} |"
                          f" {r['peak'] / 1e9:.2f} | {grown:.2f} | {grown / model_gb:.2f} |"
                          f" {r['held_bytes'] / 1e9:.2f} |", flush=True)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "meta_init_memory.json").write_text(json.dumps({"params": params, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
