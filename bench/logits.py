"""The LM head fused with its cross entropy: peak memory and step time against sequence length and vocabulary.

    OMP_NUM_THREADS=1 python bench/logits.py [--seq 1024 4096 16384] [--vocab 32000 128000]
                                             [--layouts single tp2 cp2] [--steps 3] [--rounds 1]
                                             [--batch 1] [--pp-schedule 1f1b]

A Hugging Face Llama (hidden 128, 2 layers, 4 heads, fp32, SGD) trains on batches of one sequence of each
``--seq`` tokens (``--batch`` of them under a pipeline layout, ``pp2``, which splits them into micro-batches
and runs them by ``--pp-schedule``), with the step everyone writes (``logits = self.model(input_ids=x).logits``, then
``F.cross_entropy(logits.view(-1, V), y.view(-1))``), under ``FourDStrategy`` at each layout with
``fuse_lm_loss`` on and off, for ``--steps`` training steps. Per run and rank: the peak resident memory above
what the process held when ``fit`` started (``lightning_4d.observability.telemetry.PeakMemory``; the script runs
with a fixed mmap threshold so that the resident set follows live tensors), and the wall and CPU time of the
steps after the first (median). Each figure is the largest rank's. An unfused run whose logits alone (logits,
log-softmax and their gradient: tokens x vocabulary x 12 bytes per rank) would pass ``--max-logits-gib`` is not
started, and the table says so.

The issue's goals are checked at 4,096 tokens and a vocabulary of 32,000: peak growth fused on one device at most
0.35 of the unfused one-device run, fused at tp=2 and cp=2 at most 0.2 of it per rank, and every fused step at
most 1.15 of the unfused step of its layout. Results in ``bench/results/logits.json`` and a plot
``bench/results/logits.png``.
"""

import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CPU_MALLOC_ENV, StepTimes, accelerator, command, layout, layout_parser, llama_config,  # noqa: E402
                          processes, quiet_trainer, random_tokens, run_layouts, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.observability.telemetry import PeakMemory  # noqa: E402

HIDDEN, LAYERS = 128, 2
TIMEOUT_S = 3600
GOAL_SEQ, GOAL_VOCAB = 4096, 32000
GOALS = {"single": 0.35, "tp2": 0.2, "cp2": 0.2}  # fused peak growth per rank, of the unfused one-device run's
STEP_GOAL = 1.15  # fused step time, of the unfused step's in the same layout


class Llama(pl.LightningModule):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        import transformers

        self.model = transformers.LlamaForCausalLM(llama_config(HIDDEN, LAYERS, vocab, heads=4))
        self.vocab = vocab

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.view(-1, self.vocab), y.view(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def measure(spec: str, seq: int, vocab: int, fused: bool, steps: int, batch: int = 1,
            pp_schedule: str = "1f1b") -> dict:
    pl.seed_everything(0, verbose=False)
    module = Llama(vocab)
    loader = DataLoader(random_tokens(steps * batch, seq, vocab), batch_size=batch)
    pipeline = {"pp_schedule": pp_schedule, "pp_microbatches": batch} if "pp" in layout(spec) else {}
    gc.collect()
    memory = PeakMemory(torch.device("cpu"))
    probe = StepTimes(memory)
    n = processes(spec)
    trainer = quiet_trainer(accelerator=accelerator(n), devices=n, max_steps=steps, callbacks=[probe],
                            strategy=FourDStrategy(**layout(spec), **pipeline, fuse_lm_loss=fused))
    memory.start()
    trainer.fit(module, loader)
    later = [statistics.median(r["wall"][1:]) for r in probe.ranks]
    return {"layout": spec, "seq": seq, "vocab": vocab, "fused": fused, "batch": batch, **pipeline,
            "peak_mib": max(r["peak"] for r in probe.ranks) / 2**20,
            "step_s": max(later), "cpu_s": max(statistics.median(r["cpu"][1:]) for r in probe.ranks)}


def _logits_gib(spec: str, seq: int, vocab: int) -> float:
    """What the unfused logits, their log-softmax and gradient take per rank."""
    split = layout(spec)
    return seq / split.get("cp", 1) * vocab / split.get("tp", 1) * 12 / 2**30


def goals(rows: list[dict]) -> dict:
    """The issue's goals at 4,096 tokens and a vocabulary of 32,000, from the rounds' medians."""
    def median(spec: str, fused: bool, key: str):
        values = [r[key] for r in rows if (r["layout"], r["seq"], r["vocab"], r["fused"]) ==
                  (spec, GOAL_SEQ, GOAL_VOCAB, fused) and r.get(key) is not None]
        return statistics.median(values) if values else None

    base = median("single", False, "peak_mib")
    out = {}
    for spec, goal in GOALS.items():
        peak, fused_step, unfused_step = (median(spec, True, "peak_mib"), median(spec, True, "step_s"),
                                          median(spec, False, "step_s"))
        if None in (base, peak, fused_step, unfused_step):
            continue
        out[spec] = {"peak_ratio": peak / base, "peak_goal": goal, "peak_met": peak / base <= goal,
                     "step_ratio": fused_step / unfused_step, "step_goal": STEP_GOAL,
                     "step_met": fused_step / unfused_step <= STEP_GOAL}
    return out


def main() -> None:
    parser = layout_parser(["single", "tp2", "cp2"], steps=3)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-logits-gib", type=float, default=4.0)
    parser.add_argument("--fused", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch (pp layouts: per micro-batch one)")
    parser.add_argument("--pp-schedule", default="1f1b")
    args = parser.parse_args()
    if args.worker:
        rows = []
        for spec in args.layouts:
            for vocab in args.vocab:
                for seq in args.seq:
                    for fused in args.fused:
                        if not fused and _logits_gib(spec, seq, vocab) > args.max_logits_gib:
                            rows.append({"layout": spec, "seq": seq, "vocab": vocab, "fused": False,
                                         "skipped": f"unfused logits {_logits_gib(spec, seq, vocab):.1f} GiB per"
                                                    f" rank > --max-logits-gib {args.max_logits_gib}"})
                            continue
                        rows.append(measure(spec, seq, vocab, bool(fused), args.steps, args.batch,
                                            args.pp_schedule))
        write_rows(rows, args.out)
        return
    rows = []
    for round_ in range(args.rounds):
        worker_args = ["--steps", str(args.steps), "--seq", *map(str, args.seq), "--vocab", *map(str, args.vocab),
                       "--max-logits-gib", str(args.max_logits_gib), "--fused", *map(str, args.fused),
                       "--batch", str(args.batch), "--pp-schedule", args.pp_schedule]
        for row in run_layouts(__file__, args.layouts, worker_args, TIMEOUT_S, CPU_MALLOC_ENV):
            rows.append(dict(row, round=round_))
    payload = {"command": command("logits.py"), "hidden": HIDDEN, "layers": LAYERS, "steps": args.steps,
               "results": rows, "goals": goals(rows)}
    print(table("logits", payload), f"\n(written to {write('logits', payload)})")


if __name__ == "__main__":
    main()
