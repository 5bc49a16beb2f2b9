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

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CpuStepTimer, accelerator, command, quiet_trainer, random_tokens,  # noqa: E402
                          rounds_args, write)
from bench.report import table  # noqa: E402
from lightning_4d.demos.gpt import GPT  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=128)
BATCH, SEQ = 8, 128
HAND = "Lightning ModelParallelStrategy, hand-written plan"
AUTO = "FourDStrategy(tp=2), automatic plan"


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
    data = DataLoader(random_tokens(BATCH * (steps + 1), SEQ, MODEL["vocab_size"]), batch_size=BATCH, shuffle=True)
    timer = CpuStepTimer()
    trainer = quiet_trainer(accelerator=accelerator, devices=2, strategy=strategy, max_steps=steps)
    trainer.callbacks.append(timer)
    trainer.fit(model, data)
    return timer, float(trainer.callback_metrics["train_loss"]), trainer.global_rank


def main() -> None:
    args = rounds_args()
    device = accelerator(2)
    times: dict[str, list[float]] = {HAND: [], AUTO: []}
    cpu: dict[str, list[float]] = {HAND: [], AUTO: []}
    last_loss: dict[str, float] = {}
    rank = 0
    for _ in range(args.rounds):
        for name in times:
            timer, last_loss[name], rank = run(name, args.steps, device)
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
    payload = {"command": command("tp.py"), "model": MODEL, "batch": BATCH, "seq_len": SEQ, "accelerator": device,
               "results": rows, "fourd_over_hand_written_step_time": ratio,
               "fourd_over_hand_written_cpu_time": cpu_ratio}
    print(table("tp", payload), f"\n(written to {write('tp', payload)})")


if __name__ == "__main__":
    main()
