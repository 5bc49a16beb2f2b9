"""bf16-mixed and bf16-true in every dimension, against a single-process run at the same precision.

bf16 keeps 8 bits of mantissa, so two correct runs that sum in a different order differ visibly. The stated
tolerances: losses within 2e-2 relative per step; for every weight tensor, the update (final - initial) within
10% (bf16-mixed) or 25% (bf16-true) of the single-process update in norm. Under bf16-true the weights themselves
are bf16, so an update to a weight near 1.0 (a norm gain) is rounded to steps of 2**-8 and differs between two
correct runs by a rounding step.

Where the bounds come from: two one-process runs that differ only in reduction order, the plain one and one that
sums each batch's loss as two halves (``HalvesGPT``, the order of two data-parallel replicas), measured (torch
2.13): updates apart by up to 0.68% (bf16-mixed) and 15.3% (bf16-true) of their norm, losses by 2e-5 and 7.5e-3.
The update bounds sit above that, with a margin for the other dimensions' orders (worst measured: tp=2, 1.5% and
21.6%); the loss bound also covers tensor parallelism's bf16 partial sums in the forward (1.7e-3 under bf16-mixed
at tp=2), which the halves do not model. test_the_bounds_sit_above_one_process_round_off measures the halves on
every run. The bounds still fail on a gradient error: with the first of pp=2's four micro-batches dropped
(tests/mutations.py), the updates moved by 57% of their norm (median over the weight tensors; up to 96% under
bf16-mixed, 122% under bf16-true), where the correct pp=2 runs stay within 0.7% (bf16-mixed) and 10% (bf16-true):
test_a_dropped_micro_batch_fails_the_bf16_bounds.
"""
from dataclasses import replace

import lightning.pytorch as pl
import pytest

from tests.lm_models import TINY_GPT, TinyGPT, tiny_gpt
from tests.parity import Case, reference, train, train_layout

LOSS_BOUND = 2e-2
UPDATE_BOUND = {"bf16-mixed": 0.1, "bf16-true": 0.25}

LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "cp2": {"cp": 2}, "pp2": {"pp": 2}}
PRECISIONS = ("bf16-mixed", "bf16-true")
CASES = [
    Case(f"{layout}-{precision}", module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data",
         strategy=strategy, trainer={"precision": precision}, batch_size=8, max_steps=4)
    for layout, strategy in LAYOUTS.items() for precision in PRECISIONS
]


# The bounds can fail on a gradient bug: pp=2 at its default 4 micro-batches with the first micro-batch's gradient
# dropped (tests/mutations.py).
DROPPED = [Case(f"pp2-{precision}-dropped_microbatch", module="tests.lm_models:tiny_gpt",
                data="tests.lm_models:token_data", strategy=LAYOUTS["pp2"], trainer={"precision": precision},
                batch_size=8, max_steps=4, callbacks=["tests.mutations:DroppedMicrobatch"]) for precision in PRECISIONS]


@pytest.fixture(scope="module")
def results():
    return train_layout(CASES + DROPPED, 2, timeout=900)


class HalvesGPT(TinyGPT):
    """The tiny GPT whose training loss is the mean of its batch's two halves' losses: the same mathematics,
    summed in the order of two data-parallel replicas, in one process."""

    def training_step(self, batch, batch_idx):
        first, second = zip(*(tensor.chunk(2) for tensor in batch))
        loss = (self._loss(first) + self._loss(second)) / 2
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss


def halves_gpt() -> HalvesGPT:
    return HalvesGPT(**TINY_GPT)


def _errors(case: Case, expected: dict, got: dict) -> tuple[list[float], dict[str, float]]:
    """Relative loss error per step, and each weight tensor's update error relative to the expected update."""
    assert len(got["losses"]) == len(expected["losses"]) == case.max_steps, (got["losses"], expected["losses"])
    losses = [abs(a - b) / abs(b) for a, b in zip(got["losses"], expected["losses"])]
    pl.seed_everything(case.seed, verbose=False)
    updates = {}
    for name, start in tiny_gpt().state_dict().items():
        if not start.is_floating_point():
            continue
        update = got["weights"][name].float() - start.float()
        reference_update = expected["weights"][name].float() - start.float()
        updates[name] = float((update - reference_update).norm() / reference_update.norm().clamp_min(1e-12))
    return losses, updates


def _assert_within_bf16_bounds(case: Case, expected: dict, got: dict) -> None:
    losses, updates = _errors(case, expected, got)
    for step, error in enumerate(losses):
        assert error <= LOSS_BOUND, f"{case.name}: loss at step {step} off by {error:.2e} relative"
    bound = UPDATE_BOUND[case.trainer["precision"]]
    for name, error in updates.items():
        assert error <= bound, f"{case.name}: update of {name} off by {error:.3f} of its norm"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_bounds_sit_above_one_process_round_off(precision):
    """The plain one-process run against the one that sums each batch as two halves: round-off alone, measured
    here on every run, must sit inside the bounds (else they would fail correct layouts)."""
    case = next(c for c in CASES if c.name == f"dp2-{precision}")
    plain = reference(case)
    halves = train(replace(case, name=f"halves-{precision}", module="tests.test_mixed_precision:halves_gpt",
                           strategy={}), distributed=False)
    losses, updates = _errors(case, plain, halves)
    print(f"{precision}: halves against plain: loss {max(losses):.2e}, update {max(updates.values()):.4f}")
    assert 0 < max(updates.values()) <= UPDATE_BOUND[precision], updates  # > 0: the order did change the sums
    assert max(losses) <= LOSS_BOUND, losses


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_matches_single_process_bf16(results, case):
    _assert_within_bf16_bounds(case, reference(case), results[case.name])


@pytest.mark.parametrize("case", DROPPED, ids=lambda c: c.name)
def test_a_dropped_micro_batch_fails_the_bf16_bounds(results, case):
    with pytest.raises(AssertionError, match="off by"):
        _assert_within_bf16_bounds(case, reference(case), results[case.name])
