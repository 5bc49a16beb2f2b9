"""Expert parallelism: model state per rank, step time and traffic of an 8-expert MoE at ep=1/2/4 vs dp=N.

    OMP_NUM_THREADS=1 python bench/experts.py [--layouts single dp2ep2 dp2 dp4ep4 dp4] [--hidden 64] [--steps 6]

A Hugging Face ``MixtralForCausalLM`` from a tiny config (2 layers, hidden ``--hidden``, 8 experts of intermediate
size 4 x hidden, top-2, vocabulary 256; random weights) trains ``--steps`` steps of a global batch of 8
sequences of 64 tokens (AdamW, fp32) under each layout; layouts with the same process count share one launch.

* model state: after the last optimizer step every rank counts the bytes of its parameters (local shards),
  gradients and AdamW state (exact byte counts of live tensors, not the resident set); the largest rank's.
* step time: the median wall time of the steps after the first two, on rank 0 (CPU, gloo: the ranks share the
  machine's cores, so this says how the layouts compare here, not on a cluster).
* traffic per rank per step: what expert parallelism's dispatch sent to the other ranks of its group (tokens,
  routing and results, forward and backward; rank 0's counter) and the gradient all-reduce payload (the bytes of the gradient
  buckets whose group has more than one rank: dense parameters over dp, experts over the ep replicas).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (StepTimer, command, layout, layout_parser, plot_if_possible,  # noqa: E402
                          quiet_trainer, random_tokens, run_layouts, write, write_rows)
from bench.sharded_memory import _bytes, _StateBytes  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402

VOCAB, EXPERTS, TOP_K, LAYERS = 256, 8, 2, 2
GLOBAL_BATCH, SEQ = 8, 64
TIMEOUT_S = 900
LAYOUTS = ["single", "dp2ep2", "dp2", "dp4ep4", "dp4"]


class MoELM(pl.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        import transformers

        config = transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
            max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=1, pad_token_id=None,
            attn_implementation="sdpa", experts_implementation="batched_mm")
        self.model = transformers.MixtralForCausalLM(config)
        with torch.no_grad():  # a router that depends on the token (transformers may leave it at zeros)
            for name, p in self.model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0.0, 0.5)

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        logits = self.model(input_ids=input_ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Probe(_StateBytes):
    """Every rank's model-state bytes after the last step (``bench/sharded_memory.py``'s), and rank 0's traffic."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic: dict = {}

    def on_train_end(self, trainer, pl_module):
        parallel = getattr(trainer.strategy, "parallel", None)
        if parallel is not None:
            sets = [s for b in parallel._buckets.values() for s in getattr(b, "sets", [b])]
            allreduce = sum(_bytes(p) for s in sets if s.group_size > 1 for p in s.params)
            sent = sum(d.sent_bytes for d in parallel.expert_dispatch)
            self.traffic = {"ep_bytes": sent / trainer.global_step, "allreduce_bytes": allreduce}
        super().on_train_end(trainer, pl_module)


def measure(hidden: int, spec: str, steps: int, processes: int) -> dict:
    pl.seed_everything(0, verbose=False)
    model = MoELM(hidden)
    count = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    probe, timer = _Probe(), StepTimer(warmup=2)
    strategy = FourDStrategy(**layout(spec)) if processes > 1 else "auto"
    trainer = quiet_trainer(accelerator="cpu", devices=processes, strategy=strategy, max_steps=steps,
                            callbacks=[probe, timer])
    trainer.fit(model, DataLoader(random_tokens(GLOBAL_BATCH * steps, SEQ, VOCAB),
                                  batch_size=GLOBAL_BATCH // processes))
    heaviest = max(probe.ranks, key=lambda r: sum(r.values()))
    return {"layout": spec, "processes": processes, "params": count, "expert_params": experts,
            "per_rank_mib": {k: v / 2**20 for k, v in heaviest.items()}, "total_mib": sum(heaviest.values()) / 2**20,
            "step_s": timer.median, **probe.traffic}


def main() -> None:
    parser = layout_parser(LAYOUTS, 6)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    if args.worker:
        write_rows([measure(args.hidden, spec, args.steps, args.processes) for spec in args.layouts], args.out)
        return
    rows = run_layouts(__file__, args.layouts, ["--hidden", str(args.hidden), "--steps", str(args.steps)], TIMEOUT_S)
    single = next((row["total_mib"] for row in rows if row["layout"] == "single"), None)
    print(f"MixtralForCausalLM, {rows[0]['params']:,} parameters ({rows[0]['expert_params']:,} in 8 experts per"
          " layer), AdamW fp32")
    print("| layout | processes | params MiB | grads MiB | AdamW MiB | total MiB per rank | vs one process |"
          " step s | ep KiB/step | grad all-reduce KiB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['total_mib'] / single:.3f}" if single else "-"
        part = row["per_rank_mib"]
        print(f"| {row['layout']} | {row['processes']} | {part['params']:.2f} | {part['grads']:.2f} |"
              f" {part['optimizer']:.2f} | {row['total_mib']:.2f} | {ratio} | {row['step_s']:.3f} |"
              f" {row.get('ep_bytes', 0) / 1024:.0f} | {row.get('allreduce_bytes', 0) / 1024:.0f} |")
    payload = {"command": command("experts.py"), "model": {"kind": "mixtral", "hidden": args.hidden,
                                                           "experts": EXPERTS, "top_k": TOP_K, "layers": LAYERS,
                                                           "vocab": VOCAB},
               "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "steps": args.steps, "results": rows}
    path = write("experts", payload)
    drawn = plot_if_possible("experts", payload)
    print(f"(written to {path}{f' and {drawn}' if drawn else ''})")


if __name__ == "__main__":
    main()
