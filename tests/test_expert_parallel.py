"""Mixture-of-experts models (issue #30) under tensor and expert parallelism, each against one process on the same
global batches (tests/parity.py: losses per step, logged train loss, final weights within 1e-5; fp32, SGD with
momentum):

- tp=2 without ep: Hugging Face fused 3-D experts (Qwen2-MoE with its shared expert, Mixtral) sharded on their
  intermediate dimension, one sum over tp after the combine, with ``tp_strict`` (>= 90% of the body sharded); the
  hand-written ``nn.ModuleList`` MoE, whose expert MLPs are MLP regions of their own.
- ep: 2 and 4 on Qwen2-MoE and Mixtral (eager and batched_mm experts) and the hand-written MoE, 2 on Qwen3-MoE
  and DeepSeek-V3 (group-limited routing with a bias, a shared expert, a first dense layer), ep2 x dp2, ep2 x dp_shard2
  (also HSDP), ep2 x tp2, ep2 x pp2, ep2 x cp2, ep2 with activation checkpointing, and with
  ``output_router_logits=True`` (the load-balancing loss over the global batch; dp=2 too).
- a checkpoint at ep=2 (momentum included) resumed at ep=1, ep=4 and in one process; a hand-written one at ep=4.
- which dispatch each model gets: fused experts grouped_mm reproduces are gathered (no host read), the others
  (hand-written experts, an intermediate size grouped_mm does not take) exchanged all-to-all;
- the planner's expert parameters per rank (exact) and expert-parallel bytes (balanced routing) against the runs;
  telemetry's ``comm_s/ep`` and ``comm_bytes/ep``.

One 2-process and one 4-process launch hold every case; plans, refusals and routing checks run in this process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_4d.tensor_parallel import plan_tensor_parallel
from tests.moe_models import HandMoELM, HFMoELM
from tests.parity import (Case, after_step, assert_exact_resume, assert_parity, reference, report_difference, train,
                          train_layout_with_failures)

M = "tests.moe_models:"
LM = dict(data="tests.lm_models:token_data", max_steps=3)
QWEN = dict(module=M + "HFMoELM", module_kwargs={"kind": "qwen2_moe"}, **LM)
MIXTRAL = dict(module=M + "HFMoELM", module_kwargs={"kind": "mixtral"}, **LM)
QWEN3 = dict(module=M + "HFMoELM", module_kwargs={"kind": "qwen3_moe"}, **LM)
DEEPSEEK = dict(module=M + "HFMoELM", module_kwargs={"kind": "deepseek_v3"}, **LM)  # its MLA attention stays whole
QWEN_AUX = dict(module=M + "HFMoELM", module_kwargs={"kind": "qwen2_moe", "router_aux": True}, **LM)
MIXTRAL_AUX = dict(module=M + "HFMoELM", module_kwargs={"kind": "mixtral", "router_aux": True}, **LM)
HAND = dict(module=M + "HandMoELM", **LM)
STRICT = {"tp_strict": True}

SAVE = 2
RESHARD = dict(module=M + "HFMoELM", module_kwargs={"kind": "qwen2_moe"}, data="tests.lm_models:token_data",
               max_steps=4)
# the launches' checkpoints (removed at module end): named, not made, here, since each rank imports this module
# for its callbacks; the fixture `two` makes it
WORKDIR = Path(tempfile.gettempdir()) / f"l4d_experts_{os.getpid()}"


HAND_RESHARD = dict(RESHARD, module=M + "HandMoELM", module_kwargs={})


def _saved(name: str = "qwen_ep2_saved") -> str:
    return str(WORKDIR / name / f"epoch=0-step={SAVE}.ckpt")


TELEMETRY = ["tests.test_expert_parallel:TelemetryProbe"]
PROBE = ["tests.test_expert_parallel:ExpertProbe"]
CLIP = {"gradient_clip_val": 0.3}

TWO = [
    Case("qwen_tp2", strategy={"tp": 2, **STRICT}, callbacks=PROBE, **QWEN),
    Case("mixtral_tp2", strategy={"tp": 2, **STRICT}, callbacks=PROBE, **MIXTRAL),
    Case("hand_tp2", strategy={"tp": 2, **STRICT}, **HAND),
    # The fix named when ep x tp meets experts with a fused gate|up projection: tp alone (or ep alone).
    Case("hand_fused_tp2", strategy={"tp": 2, **STRICT}, **{**HAND, "module_kwargs": {"fused": True}}),
    Case("qwen_ep2", strategy={"ep": 2}, callbacks=PROBE, **QWEN),
    Case("mixtral_ep2", strategy={"ep": 2}, callbacks=PROBE, **{**MIXTRAL, "trainer": CLIP}),
    # an intermediate size grouped_mm does not take (36): its experts' own forward, exchanged all-to-all
    Case("mixtral_ep2_unaligned", strategy={"ep": 2}, callbacks=PROBE,
         **{**MIXTRAL, "module_kwargs": {"kind": "mixtral", "inner": 36}}),
    Case("mixtral_ep2_batched_mm", strategy={"ep": 2}, callbacks=PROBE,
         **{**MIXTRAL, "module_kwargs": {"kind": "mixtral", "experts_implementation": "batched_mm"}}),
    Case("qwen_ep2_dp_shard2", strategy={"ep": 2, "dp_shard": 2}, callbacks=PROBE, **QWEN),
    Case("qwen3_ep2", strategy={"ep": 2}, callbacks=PROBE, **QWEN3),
    Case("qwen3_tp2", strategy={"tp": 2, **STRICT}, callbacks=PROBE, **QWEN3),
    Case("deepseek_v3_ep2", strategy={"ep": 2}, callbacks=PROBE, **DEEPSEEK),
    Case("hand_ep2", strategy={"ep": 2}, callbacks=PROBE, **{**HAND, "trainer": CLIP}),
    Case("hand_ep2_dp_shard2", strategy={"ep": 2, "dp_shard": 2}, callbacks=PROBE, **HAND),
    Case("qwen_ep2_cp2", strategy={"ep": 2, "cp": 2}, callbacks=PROBE, **QWEN),  # ep borrows the cp ranks
    Case("qwen_aux_ep2_cp2", strategy={"ep": 2, "cp": 2}, **QWEN_AUX),
    Case("mixtral_ep2_ac", strategy={"ep": 2, "activation_checkpointing": "full"}, callbacks=PROBE, **MIXTRAL),
    Case("hand_ep2_ac", strategy={"ep": 2, "activation_checkpointing": "full"}, callbacks=PROBE, **HAND),
    Case("qwen_aux_dp2", strategy={}, **QWEN_AUX),
    Case("qwen_aux_ep2", strategy={"ep": 2}, **QWEN_AUX),
    Case("mixtral_aux_ep2", strategy={"ep": 2}, **MIXTRAL_AUX),
    Case("qwen_ep2_telemetry", strategy={"ep": 2, "telemetry": True}, callbacks=PROBE + TELEMETRY, **QWEN),
    # a checkpoint at ep=2 (momentum included) resumes at ep=1 (dp=2) here, at ep=4 and in one process below
    Case("qwen_ep2_saved", strategy={"ep": 2}, resume_at=SAVE, **RESHARD),
    Case("qwen_ep2_to_ep1", strategy={}, resume_from=_saved(), **RESHARD),
    Case("hand_ep2_saved", strategy={"ep": 2}, resume_at=SAVE, **HAND_RESHARD),
    Case("hand_ep2_to_ep1", strategy={}, resume_from=_saved("hand_ep2_saved"), **HAND_RESHARD),
]
FOUR = [
    Case("qwen_ep2_to_ep4", strategy={"ep": 4}, resume_from=_saved(), **RESHARD),
    Case("hand_ep2_to_ep4", strategy={"ep": 4}, resume_from=_saved("hand_ep2_saved"), **HAND_RESHARD),
    Case("qwen_ep2_pp2", strategy={"ep": 2, "pp": 2}, callbacks=PROBE, **QWEN),
    Case("mixtral_ep2_pp2", strategy={"ep": 2, "pp": 2}, callbacks=PROBE, **MIXTRAL),
    Case("qwen_ep4", strategy={"ep": 4}, callbacks=PROBE, **QWEN),
    Case("hand_ep4", strategy={"ep": 4}, callbacks=PROBE, **HAND),
    Case("hand_ep2_dp2", strategy={"ep": 2}, callbacks=PROBE, **HAND),
    Case("hand_ep2_pp2", strategy={"ep": 2, "pp": 2}, callbacks=PROBE, **HAND),
    Case("mixtral_ep4", strategy={"ep": 4}, callbacks=PROBE, **MIXTRAL),
    Case("mixtral_aux_ep4", strategy={"ep": 4}, **MIXTRAL_AUX),
    Case("qwen_ep2_dp2", strategy={"ep": 2}, callbacks=PROBE, **QWEN),
    Case("mixtral_ep2_dp_shard2_hsdp", strategy={"ep": 2, "dp_shard": 2}, callbacks=PROBE, **MIXTRAL),
    Case("qwen_ep2_tp2", strategy={"ep": 2, "tp": 2, **STRICT}, callbacks=PROBE, **{**QWEN, "trainer": CLIP}),
    Case("mixtral_aux_ep2_tp2", strategy={"ep": 2, "tp": 2}, callbacks=PROBE, **MIXTRAL_AUX),
    Case("hand_ep2_tp2", strategy={"ep": 2, "tp": 2, **STRICT}, callbacks=PROBE, **{**HAND, "trainer": CLIP}),
]
ALL = {case.name: case for case in TWO + FOUR}


class ExpertProbe(Callback):
    """Per expert parameter: this rank's elements against the whole's; expert parallelism's bytes sent and
    dispatchers."""

    def parity_extras(self, trainer):
        experts = {n: p for n, p in trainer.lightning_module.named_parameters() if ".experts." in n}
        local = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in experts.items()}
        strategy = trainer.strategy
        sent = sum(d.sent_bytes for d in strategy.parallel.expert_dispatch)
        groups = {name: dist.get_process_group_ranks(strategy.mesh.group(name)) for name in ("ep", "ep_replica")
                  if strategy.parallel_dims.ep_enabled}
        return {"expert_local": local, "expert_numel": {n: p.numel() for n, p in experts.items()}, "ep_bytes": sent,
                "groups": groups, "dispatch": sorted({type(d).__name__ for d in strategy.parallel.expert_dispatch})}


class TelemetryProbe(Callback):
    """The telemetry callback's last window (logged at the end of fit: the Trainer logs every 50 steps)."""

    def parity_extras(self, trainer):
        from lightning_4d.observability.telemetry import Telemetry

        (telemetry,) = [c for c in trainer.callbacks if isinstance(c, Telemetry)]
        return {"telemetry": dict(telemetry.last_metrics)}


@pytest.fixture(scope="module")
def two():
    WORKDIR.mkdir()
    yield train_layout_with_failures(TWO, [], 2, timeout=600, workdir=str(WORKDIR))
    shutil.rmtree(WORKDIR, ignore_errors=True)


@pytest.fixture(scope="module")
def four(two):  # after two: it resumes two's checkpoint
    return train_layout_with_failures(FOUR, [], 4, timeout=600, workdir=str(WORKDIR))


def _assert_parity(name: str, got: dict) -> None:
    case = ALL[name]
    expected = reference(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got)


RESUMED = ("qwen_ep2_to_ep1", "qwen_ep2_to_ep4", "hand_ep2_to_ep4", "hand_ep2_to_ep1")


@pytest.mark.parametrize("name", [c.name for c in TWO if c.name not in RESUMED])
def test_two_processes_match_one(two, name):
    _assert_parity(name, two[0][name])


@pytest.mark.parametrize("name", [c.name for c in FOUR if c.name not in RESUMED])
def test_four_processes_match_one(four, name):
    _assert_parity(name, four[0][name])


def test_an_ep2_checkpoint_resumes_at_ep1_ep4_and_in_one_process_as_one_process_goes_on(two, four):
    records = {**two[0], **four[0]}
    assert_exact_resume(records["qwen_ep2_saved"])
    expected = after_step(reference(ALL["qwen_ep2_saved"]), SAVE)
    one = replace(ALL["qwen_ep2_saved"], name="qwen_ep2_to_one", strategy={}, resume_at=None, resume_from=_saved())
    records["qwen_ep2_to_one"] = train(one, distributed=True)  # FourDStrategy on one device
    for name in ("qwen_ep2_to_ep1", "qwen_ep2_to_ep4", "qwen_ep2_to_one"):
        report_difference(ALL["qwen_ep2_saved"], expected, records[name])
        assert_parity(replace(one, name=name), expected, records[name])


def test_a_hand_written_ep2_checkpoint_resumes_at_ep1_ep4_and_in_one_process(two, four):
    """The stacked experts of a hand-written MoE reshard like any DTensor; their checkpoint keys, weights and
    optimizer state (momentum) alike, are the ModuleList's (``experts.3.gate_proj.weight``), what one process
    saves, so that ep=1 and one process resume them."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(_saved("hand_ep2_saved")).read_metadata().state_dict_metadata
    experts = {key for key in stored if key.startswith("optimizer_0.state.layers.0.moe.experts.")}
    assert experts == {f"optimizer_0.state.layers.0.moe.experts.{index}.{name}.weight.momentum_buffer"
                       for index in range(4) for name in ("gate_proj", "up_proj", "down_proj")}, sorted(experts)
    records = {**two[0], **four[0]}
    assert_exact_resume(records["hand_ep2_saved"])
    expected = after_step(reference(ALL["hand_ep2_saved"]), SAVE)
    one = replace(ALL["hand_ep2_saved"], name="hand_ep2_to_one", strategy={}, resume_at=None,
                  resume_from=_saved("hand_ep2_saved"))
    records["hand_ep2_to_one"] = train(one, distributed=True)  # FourDStrategy on one device
    for name in ("hand_ep2_to_ep1", "hand_ep2_to_ep4", "hand_ep2_to_one"):
        report_difference(ALL["hand_ep2_saved"], expected, records[name])
        assert_parity(replace(one, name=name), expected, records[name])


@pytest.mark.parametrize("model", [HFMoELM("qwen2_moe"), HFMoELM("mixtral"), HandMoELM()],
                         ids=["qwen2_moe", "mixtral", "hand"])
def test_tp2_shards_most_of_the_moe_body(model):
    plan = plan_tensor_parallel(model, 2)
    assert plan.coverage.share >= 0.9, plan.describe()


@pytest.mark.parametrize("name,share", [("qwen_tp2", 2), ("mixtral_tp2", 2), ("qwen_ep2", 2), ("mixtral_ep2", 2),
                                        ("qwen_ep2_dp_shard2", 2), ("qwen_ep4", 4), ("mixtral_ep4", 4),
                                        ("qwen_ep2_dp2", 2), ("mixtral_ep2_dp_shard2_hsdp", 2), ("qwen_ep2_tp2", 4),
                                        ("qwen_ep2_pp2", 2), ("qwen3_ep2", 2), ("qwen3_tp2", 2),
                                        ("deepseek_v3_ep2", 2), ("hand_ep2", 2), ("hand_ep2_dp_shard2", 2),
                                        ("hand_ep4", 4), ("hand_ep2_dp2", 2), ("hand_ep2_pp2", 2),
                                        ("hand_ep2_tp2", 4)])
def test_each_rank_holds_its_share_of_the_experts(two, four, name, share):
    extras = {**two[0], **four[0]}[name]["extras"]
    assert extras["expert_local"], name
    for param, numel in extras["expert_numel"].items():
        assert extras["expert_local"][param] * share == numel, (name, param)
    assert (extras["ep_bytes"] > 0) == ("ep" in name), (name, extras["ep_bytes"])


@pytest.mark.parametrize("name,dispatch", [("qwen_ep2", "GatheredDispatch"), ("mixtral_ep2", "GatheredDispatch"),
                                           ("mixtral_ep2_batched_mm", "GatheredDispatch"),
                                           ("qwen3_ep2", "GatheredDispatch"), ("deepseek_v3_ep2", "GatheredDispatch"),
                                           ("qwen_ep2_tp2", "GatheredDispatch"),
                                           ("mixtral_ep2_unaligned", "AllToAllDispatch"),
                                           ("hand_ep2", "AllToAllDispatch"), ("hand_ep2_tp2", "AllToAllDispatch")])
def test_each_model_gets_its_dispatch(two, four, name, dispatch):
    assert {**two[0], **four[0]}[name]["extras"]["dispatch"] == [dispatch]


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_grouped_experts_reproduce_the_fused_forward(kind):
    """The gathered dispatch's arithmetic against the module's own forward: in fp32 and under bf16 autocast (as
    its linear layers would be cast), on a probe of the module's own sizes."""
    from lightning_4d.modules.experts import find_fused_experts, grouped_experts, grouped_reproduces

    model = HFMoELM(kind)
    fqn, found = next(iter(find_fused_experts(model).items()))
    experts = model.get_submodule(fqn)
    assert grouped_reproduces(experts, found)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(10, found.hidden, generator=generator)
    index = torch.stack([torch.randperm(found.experts, generator=generator)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=generator)
    order = torch.argsort(index.reshape(-1), stable=True)
    offsets = torch.bincount(index.reshape(-1), minlength=found.experts).cumsum(0).to(torch.int32)
    padded = torch.cat([tokens[order // 2], torch.full((4, found.hidden), float("nan"))])  # padding: ignored
    valid = (torch.arange(len(padded)) < len(order)).unsqueeze(1)
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            expected = type(experts).forward(experts, tokens, index, weights)
            out = grouped_experts(experts, experts.gate_up_proj, experts.down_proj,
                                  torch.where(valid, padded, 0), offsets, valid)[:len(order)]
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
        got = torch.zeros_like(tokens).index_add(0, order // 2, out.float() * weights.reshape(-1)[order, None])
        torch.testing.assert_close(got, expected.float(), rtol=2e-2 if autocast else 1e-5,
                                   atol=2e-2 if autocast else 1e-6)


def test_grouped_experts_refuse_what_they_do_not_reproduce():
    """Sizes grouped_mm does not take, and a forward of another arithmetic (up and gate swapped), fall back to the
    all-to-all of the module's own forward."""
    from lightning_4d.modules.experts import find_fused_experts, grouped_reproduces

    unaligned = HFMoELM("mixtral", inner=36)
    assert not all(grouped_reproduces(unaligned.get_submodule(f), s) for f, s in find_fused_experts(unaligned).items())
    model = HFMoELM("mixtral")
    fqn, found = next(iter(find_fused_experts(model).items()))
    experts = model.get_submodule(fqn)

    class Swapped(type(experts)):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for slot in range(top_k_index.shape[1]):
                for e in range(self.num_experts):
                    rows = top_k_index[:, slot] == e
                    up, gate = F.linear(hidden_states[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                    inner = F.linear(self.act_fn(gate) * up, self.down_proj[e])
                    out[rows] += inner * top_k_weights[rows, slot, None]
            return out

    experts.__class__ = Swapped
    assert not grouped_reproduces(experts, found)


def test_the_tiny_configs_route_to_every_expert():
    """A wrong placement of any expert must show in the weights: every expert gets tokens from a global batch."""
    from tests.lm_models import token_data

    tokens = token_data()[:8][0]
    for model in (HFMoELM("qwen2_moe"), HFMoELM("mixtral")):
        out = model.model(input_ids=tokens, output_router_logits=True)
        for logits in out.router_logits:
            chosen = logits.topk(2, dim=-1).indices.unique()
            assert chosen.numel() == 4, chosen


def test_ep_refusals_name_the_fix():
    from lightning_4d.expert_parallel import check_ep_model
    from lightning_4d.parallel_dims import ParallelDims
    from tests.lm_models import HFCausalLM

    with pytest.raises(ValueError, match=r"ep=3 does not divide the 4 experts of .*experts.*Use an ep that divides 4"):
        check_ep_model(HFMoELM("mixtral"), 3)
    with pytest.raises(ValueError, match=r"ep=2, but HFCausalLM has no mixture-of-experts layer.*Use ep=1"):
        check_ep_model(HFCausalLM("llama", layers=1), 2)
    check_ep_model(HandMoELM(), 2)  # the common form: softmax router, top-k, renormalized weighted sum
    with pytest.raises(ValueError, match=r"ep=2: the routing of layers.0.moe \(SigmoidMoE\) cannot be reached.*Fix"):
        check_ep_model(HandMoELM(sigmoid=True), 2)
    check_ep_model(HandMoELM(), 2, tp=2)  # its experts keep tp's slices (tests hand_ep2_tp2)
    from lightning_4d.composition.plans import make_plans
    from lightning_4d.pipeline import PipelineConfig
    from lightning_4d.tensor_parallel import TensorParallelConfig

    with pytest.raises(ValueError, match=r"ep=2 with tp=2: the experts of layers.0.moe \(MoE\) hold a fused projection"
                                         r" \(layers.0.moe.experts.0.gate_up_proj\).*Fix: write the expert with separate"
                                         r" gate and up linears, or use tp=1 with ep=2, or ep=1 with tp=2"):
        make_plans(HandMoELM(fused=True), ParallelDims.resolve(4, tp=2, ep=2), pipeline=PipelineConfig(1),
                   tensor=TensorParallelConfig(2))
    make_plans(HandMoELM(fused=True), ParallelDims.resolve(2, ep=2), pipeline=PipelineConfig(1),
               tensor=TensorParallelConfig(1))  # ep alone keeps each expert whole (tp alone: hand_fused_tp2)
    # The auxiliary loss under pp (its fixes: pp=1 in qwen_aux_ep2 / mixtral_aux_ep2_tp2, no aux in qwen_ep2_pp2).
    with pytest.raises(ValueError, match=r"FourDStrategy\(pp=2\) with (model\.)?config.output_router_logits=True.*Use pp=1"
                                         r" .*or set config.output_router_logits=False"):
        make_plans(HFMoELM("qwen2_moe", router_aux=True), ParallelDims.resolve(2, pp=2), pipeline=PipelineConfig(2),
                   tensor=TensorParallelConfig(1))
    with pytest.raises(ValueError, match=r"ep=4 must divide dp x cp = 2 x 1 = 2.*never from tp or pp"):
        ParallelDims.resolve(4, tp=2, ep=4)
    with pytest.raises(ValueError, match=r"ep=0 is not a valid size"):
        ParallelDims.resolve(2, ep=0)


def test_telemetry_attributes_the_all_to_all_to_ep(two):
    """Its time under ``comm_s/ep`` (the ep group shares its members with dp here, and is told apart by group),
    its bytes per rank per step under ``comm_bytes/ep``: at most what rank 0 sent in all steps."""
    record = two[0]["qwen_ep2_telemetry"]
    metrics = record["extras"]["telemetry"]
    assert metrics["telemetry/comm_s/ep"] > 0, metrics
    assert "telemetry/comm_s/dp" in metrics, metrics
    assert 0 < metrics["telemetry/comm_bytes/ep"] < record["extras"]["ep_bytes"] * 3, metrics


@pytest.mark.parametrize("name,ep", [("hand_ep2", 2), ("qwen_ep2", 2), ("mixtral_ep4", 4), ("hand_ep4", 4)])
def test_the_planner_counts_what_each_rank_holds_and_sends(two, four, name, ep):
    """Expert parameters per rank exactly; the all-to-all bytes of the run (rank 0's, 3 steps) within 25% of the
    balanced-routing estimate (the tiny routers are random, so nearly balanced)."""
    from lightning_4d.planner import MoESizes, expert_estimate

    case = ALL[name]
    record = {**two[0], **four[0]}[name]
    sizes = MoESizes.from_module(HFMoELM(**case.module_kwargs) if "HFMoELM" in case.module else HandMoELM())
    tokens = case.batch_size // ep * 16  # the rank's samples x sequence length (tests.lm_models.SEQ)
    planned = expert_estimate(sizes, ep, tokens)
    assert planned["expert_params"] == sum(record["extras"]["expert_local"].values())
    sent = record["extras"]["ep_bytes"] / case.max_steps
    assert abs(sent - planned["ep_bytes"]) <= 0.25 * planned["ep_bytes"], (sent, planned)



def test_activation_checkpointing_counts_the_recomputed_gathers_once_more(two):
    """The gathered dispatch counts each collective when it is issued, and the backward's when it runs. Under
    activation checkpointing a block's forward runs again in its backward; torch stops that recomputation once
    it has every tensor the backward saved, which is before the combining reduce-scatter. So the same 3 steps with
    and without checkpointing differ by exactly the gathers' bytes (tokens, ids, weights, per MoE layer) once
    more: not by a whole forward, and not by a second backward (what was counted before)."""
    from lightning_4d.planner import MoESizes

    case = ALL["mixtral_ep2_ac"]
    sizes = MoESizes.from_module(HFMoELM(**case.module_kwargs))
    tokens = case.batch_size // 2 * 16  # the rank's samples x sequence length (tests.lm_models.SEQ)
    gathers = sizes.layers * tokens * (sizes.hidden * 4 + sizes.top_k * (8 + 4))  # fp32 states, int64 ids, weights
    recomputed = two[0]["mixtral_ep2_ac"]["extras"]["ep_bytes"] - two[0]["mixtral_ep2"]["extras"]["ep_bytes"]
    assert recomputed == case.max_steps * gathers, (recomputed, case.max_steps * gathers)


def test_expert_groups_are_consecutive_data_parallel_ranks(two, four):
    """ep borrows consecutive dp x cp coordinates (neighbour ranks) with the same pp and tp; the ranks at one
    position of every group hold the same experts. The layout table rank 0 prints says what the run built."""
    from lightning_4d.parallel_dims import ParallelDims

    records = {**two[0], **four[0]}
    assert records["qwen_ep2_dp2"]["extras"]["groups"] == {"ep": [0, 1], "ep_replica": [0, 2]}
    assert records["qwen_ep2_tp2"]["extras"]["groups"] == {"ep": [0, 2], "ep_replica": [0]}
    assert records["qwen_ep2_pp2"]["extras"]["groups"] == {"ep": [0, 1], "ep_replica": [0]}
    table = ParallelDims.resolve(8, tp=2, ep=2).layout_table().splitlines()
    assert table[0] == "lightning-4d layout: dp=4 pp=1 cp=1 tp=2 ep=2 (from dp x cp) (world 8)"
    assert table[3].split("|")[-2:] == [" 0,2      ", " 0,4             "], table[3]
