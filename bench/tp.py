"""FourDStrategy(tp=2) with its automatic plan against Lightning's ModelParallelStrategy(tensor_parallel_size=2)
with a plan written by hand in ``configure_model``: same model, same weights, same batches, two processes.

    OMP_NUM_THREADS=1 python bench/tp.py [--steps 30] [--rounds 2]

The hand-written plan is the one of the PyTorch tensor-parallel tutorial and of Lightning's example: q/k/v
and up projections column-wise, output and down projections row-wise, the embedding row-wise, the LM head
column-wise with gathered logits, and ``n_head`` divided by hand. FourDStrategy finds the same sharding by
itself and, unlike the hand-written plan, computes the cross entropy without gathering the logits.
Lightning's launcher re-runs this script in the second process. The two strategies alternate for
``--rounds`` rounds so that neither profits from a quieter moment of the machine; each reports the median
wall time of a step after warm-up (the best round counts) and rank 0's CPU time per step (the median over
every round), which other work on a shared machine disturbs far less.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from bench.common import StepTimer, write  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 8, 128
HAND = "Lightning ModelParallelStrategy, hand-written plan"
AUTO = "FourDStrategy(tp=2), automatic plan"


class CpuStepTimer(StepTimer):
    """Also the CPU time this process spends in each step."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: list[float] = []
        self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._cpu_start = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step > self.warmup:
            self.cpu.append(time.process_time() - self._cpu_start)


class HandParallelGPT(GPT):
    """The example GPT with the tensor-parallel plan a ModelParallelStrategy user writes."""

    def configure_model(self):
        mesh = self.device_mesh["tensor_parallel"]
        gpt = self.model
        for block in gpt.layers:
            parallelize_module(block, mesh, {
                "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
            })
            block.attn.n_head //= mesh.size()  # its view() reshapes this rank's heads only
        parallelize_module(gpt, mesh, {
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })


def run(name: str, steps: int, accelerator: str) -> tuple[CpuStepTimer, float, int]:
    pl.seed_everything(0, verbose=False)
    if name == HAND:
        model, strategy = HandParallelGPT(**MODEL), ModelParallelStrategy(data_parallel_size=1,
                                                                          tensor_parallel_size=2)
    else:
        model, strategy = GPT(**MODEL), FourDStrategy(tp=2)
    tokens = torch.randint(0, 256, (BATCH * (steps + 1), SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=True)
    timer = CpuStepTimer()
    trainer = pl.Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.callbacks.append(timer)
    trainer.fit(model, data)
    return timer, float(trainer.callback_metrics["train_loss"]), trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    accelerator = "gpu" if torch.cuda.device_count() >= 2 else "cpu"
    times: dict[str, list[float]] = {HAND: [], AUTO: []}
    cpu: dict[str, list[float]] = {HAND: [], AUTO: []}
    last_loss: dict[str, float] = {}
    rank = 0
    for _ in range(args.rounds):
        for name in times:
            timer, last_loss[name], rank = run(name, args.steps, accelerator)
            times[name].append(timer.median)
            cpu[name] += timer.cpu
    if rank != 0:
        return
    tokens_per_step = BATCH * SEQ
    rows = {name: {"step_s": min(t), "tokens_per_s": tokens_per_step / min(t), "rounds_step_s": t,
                   "cpu_step_s": statistics.median(cpu[name]), "last_train_loss": last_loss[name]}
            for name, t in times.items()}
    ratio = rows[AUTO]["step_s"] / rows[HAND]["step_s"]
    cpu_ratio = rows[AUTO]["cpu_step_s"] / rows[HAND]["cpu_step_s"]
    path = write("tp", {"command": "OMP_NUM_THREADS=1 python bench/tp.py " + " ".join(sys.argv[1:]),
                        "model": MODEL, "batch": BATCH, "seq_len": SEQ, "accelerator": accelerator,
                        "results": rows, "fourd_over_hand_written_step_time": ratio,
                        "fourd_over_hand_written_cpu_time": cpu_ratio})
    print("| strategy | step time (s) | tokens/s | CPU time per step, rank 0 (s) | train loss after the last step |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['step_s']:.4f} | {row['tokens_per_s']:.0f} | {row['cpu_step_s']:.4f} |"
              f" {row['last_train_loss']:.5f} |")
    print(f"\nFourD / hand-written: step time {ratio:.3f}, CPU time {cpu_ratio:.3f}  (written to {path})")


if __name__ == "__main__":
    main()
