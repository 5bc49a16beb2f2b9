"""Two epochs per dimension against one process: most parity cases run 2-4 steps, so a bug that shows only
after an epoch boundary (the sampler's ``set_epoch`` reshuffling, an epoch-interval LR scheduler stepping,
epoch-end metrics reduced over the layout, state carried across the loop's restart) would pass them.

Each of dp=2, dp_shard=2, tp=2, cp=2 and pp=2 trains the example GPT for two epochs of 4 steps, shuffled by
Lightning's DistributedSampler (``set_epoch`` per epoch on both sides: the second epoch's batches differ from the
first's), with SGD whose learning rate a StepLR halves at each epoch's end; per-step losses and logged loss and
learning rate, the epoch means, and the final weights within 1e-5 of one process. One 2-process launch."""

import pytest
import torch

from tests.lm_models import TINY_GPT, TinyGPT, token_data
from tests.parity import Case, assert_parity, reference, train_layout

LAYOUTS = {"dp2": {"dp": 2}, "dp_shard2": {"dp_shard": 2}, "tp2": {"tp": 2}, "cp2": {"cp": 2},
           "pp2": {"pp": 2}}
STEPS_PER_EPOCH = len(token_data()) // 8


class ScheduledGPT(TinyGPT):
    """The example GPT with an epoch-interval StepLR, logging its learning rate per step and its loss per epoch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)}


def scheduled_gpt() -> ScheduledGPT:
    return ScheduledGPT(**TINY_GPT)


CASES = [Case(f"two_epochs_{name}", module="tests.test_two_epochs:scheduled_gpt", data="tests.lm_models:token_data",
              strategy=sizes, batch_size=8, max_steps=-1, trainer={"max_epochs": 2})
         for name, sizes in LAYOUTS.items()]


@pytest.fixture(scope="module")
def records():
    return train_layout(CASES, 2, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_two_epochs_match_one_process(records, case):
    expected = reference(case)
    assert len(expected["losses"]) == 2 * STEPS_PER_EPOCH and len(expected["epochs"]) == 2
    # The schedule acted: the second epoch ran at half the first's rate.
    assert [row["lr"] for row in expected["logged"]][STEPS_PER_EPOCH - 1:STEPS_PER_EPOCH + 1] == [0.5, 0.25]
    assert_parity(case, expected, records[case.name], metrics=("train_loss", "lr"), epoch_metrics=("epoch_loss",))
