"""Many launches of a long expert-parallel training, outside the suite: the rate of launches that do not exit 0
on every rank (docs/troubleshooting.md, "A rank dies mid-run on CPU").

    OMP_NUM_THREADS=1 python -m tests.expert_parallel_stress [LAUNCHES] [STEPS]

Each launch trains the suite's Hugging Face Qwen2-MoE (tests/moe_models.py) with ``FourDStrategy(ep=2)`` on 2
gloo ranks for STEPS steps (1000 by default), with the host-sync counter of tests/test_host_syncs.py on steps
3 to 8 as there. Printed: each failed launch's exit codes and every rank's last lines, then the launches, the
failures and the time taken."""

import sys
import time

STEPS = 1000


def train(steps: int) -> None:
    """One rank of a launch."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from tests.host_syncs import CountSteps
    from tests.lm_models import token_data
    from tests.moe_models import HFMoELM

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(ep=2), max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=50,
                         callbacks=[CountSteps(first=3, last=8)])
    trainer.fit(HFMoELM(kind="qwen2_moe"), DataLoader(token_data(size=8 * steps + 8), batch_size=4))
    assert trainer.global_step == steps, trainer.global_step


def main(launches: int, steps: int) -> int:
    from tests.parity import launch, rank_tails

    start, failures = time.monotonic(), 0
    for attempt in range(launches):
        codes, output = launch(["-m", "tests.expert_parallel_stress", "--rank", str(steps)], 2, timeout=600)
        if codes != [0, 0]:
            failures += 1
            print(f"launch {attempt}: exit codes {codes}\n{rank_tails(output, 1500)}", flush=True)
    print(f"{launches} launches of {steps} steps, {failures} not exiting 0 on every rank,"
          f" {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        train(int(sys.argv[2]))
    else:
        sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20, int(sys.argv[2]) if len(sys.argv) > 2 else STEPS))
