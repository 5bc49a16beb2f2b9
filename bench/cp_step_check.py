"""The context-parallel step check's cost: the first training step with ``cp_check`` on and off.

    OMP_NUM_THREADS=1 python bench/cp_step_check.py [--seq 1024 4096] [--hidden 256] [--layers 4] [--rounds 2]
                                                    [--check-tokens 1024]

A Hugging Face Llama (``--hidden``, ``--layers``, vocabulary 8192, fp32, SGD) trains 2 steps at cp=2 on a batch
of 2 sequences of each ``--seq`` tokens, once with the step check (the default, its sample cut to
``--check-tokens``) and once without, alternating ``--rounds`` times, each in fresh processes. Per run and rank:
the first training step's wall and CPU time (the check runs in it) and the second's, and the peak resident memory
above what the process held before the model was built (``lightning_4d.observability.telemetry.PeakMemory``). The figure is
the largest rank's. Results go to ``bench/results/cp_step_check.json``.
"""

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (CPU_MALLOC_ENV, StepTimes, accelerator, command, layout_parser, llama_config,  # noqa: E402
                          quiet_trainer, random_tokens, run_worker, write, write_rows)
from bench.report import table  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.observability.telemetry import PeakMemory  # noqa: E402

VOCAB, BATCH, CP = 8192, 2, 2
TIMEOUT_S = 1200


class Llama(pl.LightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        import transformers

        self.model = transformers.LlamaForCausalLM(llama_config(hidden, layers, VOCAB))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def measure(seq: int, hidden: int, layers: int, check: bool, tokens: int) -> dict:
    memory = PeakMemory(torch.device("cpu"))
    gc.collect()
    pl.seed_everything(0, verbose=False)
    memory.start()
    steps = StepTimes(memory)
    trainer = quiet_trainer(accelerator=accelerator(CP), devices=CP, max_steps=2, callbacks=[steps],
                            strategy=FourDStrategy(cp=CP, cp_check=check, cp_check_tokens=tokens))
    trainer.fit(Llama(hidden, layers), DataLoader(random_tokens(2 * BATCH, seq, VOCAB), batch_size=BATCH))
    return {"seq": seq, "check": check, "check_tokens": tokens,
            "first_step_wall_s": max(r["wall"][0] for r in steps.ranks),
            "first_step_cpu_s": max(r["cpu"][0] for r in steps.ranks),
            "second_step_wall_s": max(r["wall"][1] for r in steps.ranks),
            "peak_mib": max(r["peak"] for r in steps.ranks) / 2**20}


def main() -> None:
    parser = layout_parser(["cp2"], steps=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check-tokens", type=int, default=1024)
    parser.add_argument("--check", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        write_rows([measure(s, args.hidden, args.layers, bool(args.check), args.check_tokens) for s in args.seq],
                   args.out)
        return
    rows = []
    for round_ in range(args.rounds):
        for check in (1, 0):
            for row in run_worker(__file__, ["--seq", *map(str, args.seq), "--hidden", str(args.hidden),
                                             "--layers", str(args.layers), "--check", str(check),
                                             "--check-tokens", str(args.check_tokens)], TIMEOUT_S, CPU_MALLOC_ENV):
                rows.append(dict(row, round=round_))
    payload = {"command": command("cp_step_check.py"), "hidden": args.hidden, "layers": args.layers,
               "vocab": VOCAB, "batch": BATCH, "cp": CP, "results": rows}
    print(table("cp_step_check", payload), f"\n(written to {write('cp_step_check', payload)})")


if __name__ == "__main__":
    main()
