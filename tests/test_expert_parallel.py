"""Mixture-of-experts models (issue #30) under tensor and expert parallelism, each against one process on the same
global batches (tests/parity.py: losses per step, logged train loss, final weights within 1e-5; fp32, SGD):

- tp=2 without ep: Hugging Face fused 3-D experts (Qwen2-MoE with its shared expert, Mixtral) sharded on their
  intermediate dimension, one sum over tp after the combine, with ``tp_strict`` (>= 90% of the body sharded); the
  hand-written ``nn.ModuleList`` MoE, whose expert MLPs are MLP regions of their own.

One 2-process launch holds every case; plans, refusals and routing checks run in this process.
"""

from __future__ import annotations

import pytest
import torch

from lightning_4d.tensor_parallel import plan_tensor_parallel
from tests.moe_models import HandMoELM, HFMoELM
from tests.parity import Case, assert_parity, reference, report_difference, train_layout_with_failures

M = "tests.moe_models:"
LM = dict(data="tests.lm_models:token_data", max_steps=3)
QWEN = dict(module=M + "HFMoELM", module_kwargs={"kind": "qwen2_moe"}, **LM)
MIXTRAL = dict(module=M + "HFMoELM", module_kwargs={"kind": "mixtral"}, **LM)
HAND = dict(module=M + "HandMoELM", **LM)
STRICT = {"tp_strict": True}

TWO = [
    Case("qwen_tp2", strategy={"tp": 2, **STRICT}, **QWEN),
    Case("mixtral_tp2", strategy={"tp": 2, **STRICT}, **MIXTRAL),
    Case("hand_tp2", strategy={"tp": 2, **STRICT}, **HAND),
]
ALL = {case.name: case for case in TWO}


@pytest.fixture(scope="module")
def two():
    return train_layout_with_failures(TWO, [], 2, timeout=600)


@pytest.mark.parametrize("name", [c.name for c in TWO])
def test_two_processes_match_one(two, name):
    case = ALL[name]
    expected = reference(case)
    report_difference(case, expected, two[0][name])
    assert_parity(case, expected, two[0][name])


@pytest.mark.parametrize("model", [HFMoELM("qwen2_moe"), HFMoELM("mixtral"), HandMoELM()],
                         ids=["qwen2_moe", "mixtral", "hand"])
def test_tp2_shards_most_of_the_moe_body(model):
    plan = plan_tensor_parallel(model, 2)
    assert plan.coverage.share >= 0.9, plan.describe()
