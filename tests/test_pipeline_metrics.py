"""Per-step torchmetrics values under pipeline parallelism equal one process's, for metrics that are not linear in
the batch (Perplexity, macro F1): the step's micro-batches update the metric one after another, and the value
logged per step is the whole batch's (a copy of the metric updated with every micro-batch), not the mean of the
micro-batches' values (5e-3 off for Perplexity before). At pp=2 (gpipe and 1f1b) and pp2 x tp2, 1e-5, with the
epoch values; the 2-process launch also runs the mean of the micro-batch values as a negative control."""

import pytest

from tests.parity import Case, assert_parity, reference, report_difference, train_layout

METRICS = dict(module="tests.pipeline_metric_models:MetricGPT", data="tests.lm_models:token_data", max_steps=3)
TWO = [Case("metrics_pp2_1f1b", strategy={"pp": 2}, **METRICS),
       Case("metrics_pp2_gpipe", strategy={"pp": 2, "pp_schedule": "gpipe"}, **METRICS)]
FOUR = [Case("metrics_pp2_tp2", strategy={"pp": 2, "tp": 2}, **METRICS)]


@pytest.fixture(scope="module")
def records():
    return {**train_layout(TWO, 2, timeout=300), **train_layout(FOUR, 4, timeout=300)}


@pytest.mark.parametrize("case", TWO + FOUR, ids=lambda case: case.name)
def test_step_values_match_one_process(records, case):
    expected = reference(case)
    report_difference(case, expected, records[case.name])
    assert_parity(case, expected, records[case.name], metrics=("train_loss", "train_ppl", "train_f1"),
                  epoch_metrics=("train_ppl", "train_f1"))


def test_the_mean_of_the_micro_batches_differs(records):
    """The negative control: the micro-batches' mean of Perplexity is not the batch's (so parity can fail)."""
    import torch
    import torchmetrics

    from tests.parity import _load

    inputs, labels = (t[:8] for t in _load(METRICS["data"])(True).tensors)
    torch.manual_seed(0)
    logits = torch.randn(8, inputs.size(1), 64) * 3
    whole = torchmetrics.text.Perplexity()(logits, labels)
    parts = [torchmetrics.text.Perplexity()(logits[i:i + 2], labels[i:i + 2]) for i in range(0, 8, 2)]
    assert abs(float(torch.stack(parts).mean()) - float(whole)) > 1e-3 * float(whole)
