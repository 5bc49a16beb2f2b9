"""What a rank's step sees under context parallelism: one process's answer, or a refusal that names the step.

Each pattern of ``tests/cp_step_models.py`` is a training step written the way users write it, on a tiny
Hugging Face Llama, at cp=2, cp=4, cp2 x tp2 and cp2 x pp2:

- steps that compute something else on a shard (a last-n loss, position weights, a prompt mask and a masked-LM
  mask built in the step, ``logits[:, :-1]`` shifted in the step) are refused by the step check on every rank,
  before the first optimizer step, naming the step and the values (``StepMismatch``);
- steps that fail on a shard but run whole (one token tensor shifted in the step, as Lightning's tensor-parallel
  example does; position ids for packed documents and a padding mask built in the step) are refused with the
  check's explanation before their own error;
- torchmetrics metrics logged per step (accuracy and perplexity, per step and per epoch) train at parity at cp=2,
  cp=4 and cp2 x tp2, their step values the whole batch's; under cp2 x pp2 such a metric is refused with its fix,
  and the fix (logged per epoch) trains at parity;
- a sample count logged with ``reduce_fx="sum"`` is taken once instead of summed over cp, a token count summed
  (learned by the check), both at parity with one process;
- the same steps rewritten with ``lightning_4d.sequence_positions`` or with the mask built in the data train at
  parity (<= 1e-5: loss per step, logged values, final weights); a step drawing a random number trains the
  same, to the bit, with the check on and off (the check leaves the random stream as it was; a metric logged
  per epoch at parity shows that it leaves metric states as they were).

At cp=2 the silent patterns also run with the check off (``cp_check=False``): each then differs from one process
(the check is what makes them loud), and the sample count is logged twice over.
Process start-up dominates: one launch per world size runs every case.
"""

from dataclasses import replace

import pytest
import torch

from lightning_4d.context_parallel.config import ContextParallelConfig
from lightning_4d.context_parallel.document_layout import balanced_layout
from lightning_4d.context_parallel.masks import packed_documents
from tests.cp_step_models import (AT_PARITY, DATA, FAILING_ON_SHARD, PER_STEP_METRIC, SILENT, StepPatternLlama,
                                  packed_positions)
from tests.parity import (Case, assert_error, assert_parity, max_difference, reference, report_difference,
                          train_layout_with_failures)

MODULE = "tests.cp_step_models:StepPatternLlama"
LAYOUTS = {"cp2": {"cp": 2}, "cp4": {"cp": 4}, "cp2_tp2": {"cp": 2, "tp": 2}, "cp2_pp2": {"cp": 2, "pp": 2}}
METRICS = {"counts": ("train_loss", "samples", "tokens"),
           "metric_per_step": ("train_loss", "train_acc_step", "train_perplexity_step")}
EPOCH_METRICS = {"metric_per_epoch": ("train_acc",), "metric_per_step": ("train_acc_epoch", "train_perplexity_epoch")}


def case(layout: str, pattern: str, **strategy) -> Case:
    return Case(f"{layout}_{pattern}" + ("_unchecked" if strategy.get("cp_check") is False else ""), module=MODULE,
                module_kwargs={"pattern": pattern}, data=DATA.get(pattern, "tests.lm_models:token_data"),
                strategy={**LAYOUTS[layout], **strategy}, max_steps=2)


def cases_at(layout: str) -> tuple[list[Case], list[Case]]:
    """Per-step torchmetrics values are the whole batch's under cp (and cp x tp); under cp x pp still refused."""
    per_step = (PER_STEP_METRIC,)
    parity, failing = AT_PARITY + (per_step if "pp" not in layout else ()), SILENT + FAILING_ON_SHARD
    return [case(layout, p) for p in parity], [case(layout, p) for p in failing + (per_step if "pp" in layout else ())]


# the silent patterns with the check off: they train, and differ from one process
UNCHECKED = [case("cp2", p, cp_check=False) for p in (*SILENT, "counts")]
RANDOM = [case("cp2", "random_scale"), case("cp2", "random_scale", cp_check=False)]
# the sample is cut to 8 of the 16 tokens (a multiple of 2 x cp): still refused
TRUNCATED = replace(case("cp2", "last_n", cp_check_tokens=10), name="cp2_last_n_truncated")

MISMATCH = ["StepMismatch", ["changes what StepPatternLlama.training_step computes", "the returned loss:",
                             "No weight has changed", "lightning_4d.sequence_positions(x)", "cp_check=False"]]
ON_SHARD = ["fails on this rank's shard of the sequence but runs on the whole sample",
            "before any weight changed", "input_ids = tokens[:-1], labels = tokens[1:]"]
EXPECTED = {
    **{p: MISMATCH for p in SILENT},
    "one_tensor_shift": ["ValueError", ON_SHARD],
    PER_STEP_METRIC: ["StepMismatch", ["'train_acc', a torchmetrics metric logged per step", "on_step=False"]],
}
# A mask or position ids built from the shard fail where a shard holds what makes the mask (a separator, padding)
# and give other values where none does, by layout: either refusal names the step.
EITHER = {"packed_positions", "padding_in_step"}


def assert_refused(outcomes: list[str], pattern: str) -> None:
    if pattern not in EITHER:
        assert_error(outcomes, *EXPECTED[pattern])
        return
    for rank, outcome in enumerate(outcomes):
        kind = outcome.split(":")[0]
        assert kind in ("StepMismatch", "ValueError"), (rank, outcome)
        phrases = MISMATCH[1] if kind == "StepMismatch" else ON_SHARD + ["cannot carry over to the whole sequence"]
        for phrase in phrases:
            assert phrase in outcome, (rank, phrase, outcome)


# The cp rank holding the first token of the packed rows (tests/cp_step_models.py), in their document layout.
_FIRST_TOKEN_RANK = int((balanced_layout(packed_documents(packed_positions()[None]), 2).positions == 0).any(1)
                        .nonzero()[0])
# Models whose forward computes something else on a shard: the refusal names the module that makes the
# difference (its inputs still match the whole run's, its output does not) and what that says it does.
NAMED = {
    "pooler": (Case("cp2_pooler", module="tests.cp_step_models:PoolerClassifier",
                    data="tests.cp_step_models:classified_tokens", strategy={"cp": 2}, max_steps=2),
               ["model.bert.pooler (BertPooler) is the first module whose output differs", "no sequence dim",
                "only on cp rank 0, which holds the sequence's first and last tokens"]),
    "last_token": (Case("cp2_last_token", module="tests.cp_step_models:LastTokenClassifier",
                        data="tests.cp_step_models:classified_tokens", strategy={"cp": 2}, max_steps=2),
                   ["model (LlamaForSequenceClassification) is the first module whose output differs",
                    "only on cp rank 0"]),
    # packed rows: the rank that holds the first token is the document layout's
    "pooler_packed": (Case("cp2_pooler_packed", module="tests.cp_step_models:PackedPoolerClassifier",
                           data="tests.cp_step_models:classified_packed_tokens", strategy={"cp": 2}, max_steps=2),
                      ["model.bert.pooler (BertPooler) is the first module whose output differs",
                       f"only on cp rank {_FIRST_TOKEN_RANK}, which holds the sequence's first token: it reads it"]),
    "position_scale": (Case("cp2_position_scale", module="tests.cp_step_models:PositionScaledLlama",
                            data="tests.lm_models:token_data", strategy={"cp": 2}, max_steps=2),
                       ["model.model.embed_tokens.1 (PositionScale) is the first module whose output differs from the"
                        " whole run's at the same tokens", "torch.arange(x.size(1))"]),
}


@pytest.fixture(scope="module")
def two():
    parity, failing = cases_at("cp2")
    return train_layout_with_failures(parity + UNCHECKED + RANDOM,
                                      failing + [TRUNCATED] + [case for case, _ in NAMED.values()], 2, timeout=600)


@pytest.mark.parametrize("name", list(NAMED))
def test_the_refusal_names_the_module_that_differs(two, name):
    case, phrases = NAMED[name]
    assert_error(two[1][case.name], "StepMismatch", ["changes what", *phrases])


def test_a_difference_made_in_the_step_is_said_to_be_there(two):
    assert_error(two[1]["cp2_last_n"], "StepMismatch",
                 ["Every module's output on the shard equals the whole run's at the same tokens: the difference is"
                  " made in StepPatternLlama.training_step itself"])


@pytest.fixture(scope="module")
def four():
    parity, failing = [], []
    for layout in ("cp4", "cp2_tp2", "cp2_pp2"):
        more_parity, more_failing = cases_at(layout)
        parity, failing = parity + more_parity, failing + more_failing
    return train_layout_with_failures(parity, failing, 4, timeout=900)


def _parity(records, layout: str, pattern: str) -> None:
    got = records[f"{layout}_{pattern}"]
    expected = reference(case(layout, pattern))
    report_difference(case(layout, pattern), expected, got)
    assert_parity(case(layout, pattern), expected, got, metrics=METRICS.get(pattern, ("train_loss",)),
                  epoch_metrics=EPOCH_METRICS.get(pattern, ()))


@pytest.mark.parametrize("pattern", [c.module_kwargs["pattern"] for c in cases_at("cp2")[0]])
def test_cp2_matches_single_process(two, pattern):
    _parity(two[0], "cp2", pattern)


@pytest.mark.parametrize("layout_pattern", [f"{layout}:{c.module_kwargs['pattern']}"
                                            for layout in ("cp4", "cp2_tp2", "cp2_pp2") for c in cases_at(layout)[0]])
def test_four_ranks_match_single_process(four, layout_pattern):
    layout, pattern = layout_pattern.split(":")
    _parity(four[0], layout, pattern)


def _failing(layout: str) -> list[str]:
    return [c.module_kwargs["pattern"] for c in cases_at(layout)[1]]


@pytest.mark.parametrize("pattern", _failing("cp2"))
def test_cp2_refuses_on_every_rank(two, pattern):
    assert_refused(two[1][f"cp2_{pattern}"], pattern)


@pytest.mark.parametrize("layout_pattern", [f"{layout}:{p}" for layout in ("cp4", "cp2_tp2", "cp2_pp2")
                                            for p in _failing(layout)])
def test_four_ranks_refuse_on_every_rank(four, layout_pattern):
    layout, pattern = layout_pattern.split(":")
    assert_refused(four[1][f"{layout}_{pattern}"], pattern)


def test_the_check_leaves_no_trace(two):
    checked, unchecked = (two[0][c.name] for c in RANDOM)
    assert checked["losses"] == unchecked["losses"] and checked["logged"] == unchecked["logged"]
    for name, value in unchecked["weights"].items():
        assert torch.equal(checked["weights"][name], value), name


def test_the_sample_is_cut_to_the_check_tokens(two):
    assert_error(two[1]["cp2_last_n_truncated"], MISMATCH[0], MISMATCH[1] + ["(8 tokens per sequence)"])


@pytest.mark.parametrize("unchecked", UNCHECKED, ids=lambda c: c.name)
def test_without_the_check_the_silent_steps_differ_from_one_process(two, unchecked):
    """What the check prevents: with it off, each of these trains another model than one process (or, for the
    counts, logs another value), without a word."""
    got = two[0][unchecked.name]
    expected = reference(replace(unchecked, strategy={}))
    report_difference(unchecked, expected, got)
    assert len(got["losses"]) == len(expected["losses"]) == unchecked.max_steps
    if unchecked.module_kwargs["pattern"] == "counts":
        assert [entry["samples"] for entry in got["logged"]] == [16.0, 16.0]  # summed over cp: one process logs 8
        assert [entry["samples"] for entry in expected["logged"]] == [8.0, 8.0]
        return
    loss, weight = max_difference(expected, got)
    assert loss > 1e-3 or weight > 1e-4, f"{unchecked.name}: within {loss:.2e} (loss), {weight:.2e} (weights)"


# ------------------------------------------------------------------------------ without processes


def test_check_options_are_validated():
    from lightning_4d import FourDStrategy

    assert FourDStrategy(cp=2, cp_check=False).cp_config.check is False
    assert ContextParallelConfig(cp=2).check_tokens == 1024
    with pytest.raises(ValueError, match="cp_check='yes' must be True .* or False"):
        FourDStrategy(cp=2, cp_check="yes")
    with pytest.raises(ValueError, match="cp_check_tokens=0 must be a positive number of tokens.*cp_check=False"):
        FourDStrategy(cp=2, cp_check_tokens=0)


def test_sequence_positions_without_context_parallelism():
    from lightning_4d import sequence_positions

    positions, length = sequence_positions(torch.zeros(2, 6, 3))
    assert positions.tolist() == list(range(6)) and length == 6
    assert sequence_positions(torch.zeros(5, 2), dim=0).length == 5


def test_step_patterns_run_in_one_process():
    """Every pattern is a working step on one process (the refusals are about cp, not broken code)."""
    from tests.cp_step_models import DATA as data_of
    from tests.parity import _load

    for pattern in (*SILENT, *FAILING_ON_SHARD, PER_STEP_METRIC, *AT_PARITY):
        module = StepPatternLlama(pattern)
        batch = [t[:2] for t in _load(data_of.get(pattern, "tests.lm_models:token_data"))(True).tensors]
        module.log = lambda *args, **kwargs: None
        assert torch.isfinite(module.training_step(batch, 0)), pattern
