"""The three library patterns of issue #28, each trained against one process on the same global batches
(losses per step, logged train loss, final weights within 1e-5; fp32, SGD, dropout 0; gradients clipped
below their norm, so the clip's global norm over plain and DTensor gradients takes part):

1. In-place arithmetic into what a tensor-parallel layer returns (``h += residual`` on an attention's output,
   ``m.add_(h)`` on an MLP's, ``q *= scale`` on a projection's, ``x *= sqrt(dim)`` on the token embedding's,
   ``logits *= 2.0``, ``logits.add_(bias)``, ``masked_fill_`` on the LM head's vocabulary-sharded logits):
   torch's styles return ``DTensor.to_local()``, a view made inside an autograd Function, which autograd
   forbids modifying in place; the logits' change must reach the vocabulary-parallel loss. At tp=2, tp=2 with
   sequence parallelism, tp2 x cp2 (with and without it).
2. Scaled-dot-product attention with one key/value head broadcast over the query heads, without ``enable_gqa``
   (legal in torch): ring attention used to demand ``enable_gqa``. At cp=2, tp=2 (query heads split, the one
   key/value head whole on both ranks), tp=2 with sequence parallelism, tp2 x cp2; what torch rejects (2
   key/value heads for 4 query heads without ``enable_gqa``) is rejected with torch's error on every rank.
3. A norm over a whole q/k projection (Hugging Face ``Olmo2ForCausalLM``'s ``q_norm``/``k_norm``): refused
   before, now sharded with the projection (``sharded_norm``), its statistic from one all-reduce of the per-rank
   sums of squares. At tp=2 (also with sequence parallelism), tp=4, tp2 x cp2 and dp_shard2 x tp2, each with
   ``tp_strict``; a LayerNorm over whole projections (no RMSNorm: DTensor's generic path) at tp=2.

Also Lightning's ``gradient_clip_algorithm="value"`` at dp=2, dp_shard=2, tp=2, pp=2, cp=2 and dp_shard2 x tp2, at
parity (torch's foreach clamp refused a list mixing DTensor and plain gradients under tp), with a bound that
changes the run.

One 2-process and one 4-process launch (tests/parity.py) hold every case; probes in those launches show that
torch's own style still fails where ours does not (pattern 1) and count the norm's collectives against a
wrong, rank-local statistic (pattern 3). The rest runs in this process: plans, refusals, torch's shape rules.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from lightning_4d.context_parallel.sdpa_shapes import sdpa_operands
from lightning_4d.tensor_parallel import plan_tensor_parallel
from lightning_4d.tensor_parallel.styles import _OwnTensor, own_output, rms_form
from tests.library_pattern_models import BroadcastKVGPT, Olmo2LM
from tests.parity import Case, assert_error, assert_parity, max_difference, reference, report_difference
from tests.test_tp_strategy import _launch  # one launch per world size, its failing cases too (timeout 600 s)

CLIP = {"gradient_clip_val": 0.3}
SHARDING = "tests.test_tp_strategy:ShardingProbe"
M = "tests.library_pattern_models:"
LM = dict(data="tests.lm_models:token_data", max_steps=4, trainer=CLIP)
INPLACE = dict(module=M + "InplaceGPT", callbacks=[SHARDING, "tests.test_library_patterns:InplaceProbe"], **LM)
BROADCAST = dict(module=M + "BroadcastKVGPT", callbacks=[SHARDING], **LM)
OLMO2 = dict(module=M + "Olmo2LM", callbacks=[SHARDING, "tests.test_library_patterns:NormProbe"], **LM)
STRICT = {"tp_strict": True}
SP = {"sequence_parallel": True}

# Lightning's gradient_clip_algorithm="value" (elementwise) in every dimension: a bound below most gradient
# elements of the first steps, so that clipping changes the run.
CLIP_VALUE = dict(module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data", max_steps=3,
                  trainer={"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"})
CLIP_VALUE_TWO = [Case(f"clip_value_{name}", strategy=strategy, **CLIP_VALUE)
                  for name, strategy in (("dp2", {"dp": 2}), ("dp_shard2", {"dp_shard": 2}), ("tp2", {"tp": 2}),
                                         ("pp2", {"pp": 2}), ("cp2", {"cp": 2}))]
CLIP_VALUE_FOUR = [Case("clip_value_dp_shard2_tp2", strategy={"dp_shard": 2, "tp": 2}, **CLIP_VALUE)]

TWO = [
    Case("inplace_tp2", strategy={"tp": 2}, **INPLACE),
    Case("inplace_tp2_sp", strategy={"tp": 2, **SP}, **INPLACE),
    Case("broadcast_kv_cp2", strategy={"cp": 2}, **BROADCAST),
    Case("broadcast_kv_tp2", strategy={"tp": 2}, **BROADCAST),
    Case("broadcast_kv_tp2_sp", strategy={"tp": 2, **SP}, **BROADCAST),
    Case("olmo2_tp2", strategy={"tp": 2, **STRICT}, **OLMO2),
    Case("olmo2_tp2_sp", strategy={"tp": 2, **SP, **STRICT}, **OLMO2),
    Case("layernorm_qk_tp2", module=M + "LayerNormQKGPT", strategy={"tp": 2, **STRICT}, callbacks=[SHARDING], **LM),
    # logits[..., 0] = -1 on the fused LM head: applied to each chunk of tokens, each rank's share of the vocabulary
    Case("logits_assignment_tp2", module=M + "LogitsAssignGPT", strategy={"tp": 2}, callbacks=[SHARDING], **LM),
]
FOUR = [
    Case("inplace_tp2_cp2", strategy={"tp": 2, "cp": 2}, **INPLACE),
    Case("inplace_tp2_cp2_sp", strategy={"tp": 2, "cp": 2, **SP}, **INPLACE),
    Case("broadcast_kv_tp2_cp2", strategy={"tp": 2, "cp": 2}, **BROADCAST),
    Case("olmo2_tp2_cp2", strategy={"tp": 2, "cp": 2, **STRICT}, **OLMO2),
    Case("olmo2_tp4", strategy={"tp": 4, **STRICT}, **OLMO2),
    # FSDP2 around the sharded norm: it all-gathers the dp_shard shards of its tp-sharded weight before forward.
    Case("olmo2_dp_shard2_tp2", strategy={"dp_shard": 2, "tp": 2, **STRICT},
         **{**OLMO2, "callbacks": [SHARDING]}),
]
# name -> (case, exception type, phrases of its message); each rank must raise it.
TORCH_MISMATCH = "The size of tensor a (4) must match the size of tensor b (2) at non-singleton dimension 1"
FAILING_TWO = {
    "two_kv_heads_without_gqa_cp2": (
        Case("two_kv_heads_without_gqa_cp2", module=M + "TwoKVHeadsWithoutGQA", data=LM["data"],
             strategy={"cp": 2}, max_steps=1),
        "RuntimeError", [TORCH_MISMATCH, "torch's scaled_dot_product_attention rejects these shapes too",
                         "key (8, 2, 8, 8)", "enable_gqa=False"]),
    # Assignment into the vocabulary-sharded logits of an unfused head: DTensor cannot, and a gathered copy would
    # not reach the loss (fused, each chunk of tokens applies it: logits_assignment_tp2 trains).
    "logits_assignment_tp2_unfused": (
        Case("logits_assignment_tp2_unfused", module=M + "LogitsAssignGPT", data=LM["data"],
             strategy={"tp": 2, "fuse_lm_loss": False}, max_steps=1),
        "ValueError", ["Assignment into the LM head's logits (logits[...] = value)",
                       "Fix: logits = logits.masked_fill(mask, value)", "loss_parallel=False"]),
}
ALL = {case.name: case for case in TWO + FOUR}


class InplaceProbe(Callback):
    """On the trained layout's tp group: torch's own row-wise style still hands back a view that in-place
    arithmetic refuses (the cause), and the same layer with lightning_4d's output hook takes ``y += 1`` with the
    gradients of one process."""

    def parity_extras(self, trainer):
        mesh = trainer.strategy.mesh.mesh["tp"]
        tp, rank = mesh.size(), mesh.get_local_rank()
        torch.manual_seed(0)
        whole = nn.Linear(8, 4)
        x = torch.randn(3, 8)
        expected = whole(x)
        expected += 1
        (expected * expected.detach()).sum().backward()
        found = {}
        for name, hooked in (("torch", False), ("ours", True)):
            layer = nn.Linear(8, 4)
            layer.load_state_dict(whole.state_dict())
            parallelize_module(layer, mesh, RowwiseParallel())
            if hooked:
                layer.register_forward_hook(own_output)
            y = layer(x.chunk(tp, -1)[rank])
            try:
                y += 1
                (y * y.detach()).sum().backward()
            except RuntimeError as error:
                found[name] = str(error)
                continue
            grad = layer.weight.grad.full_tensor()
            found[name] = max((y - expected).abs().max().item(), (grad - whole.weight.grad).abs().max().item())
        return {"inplace": found}


class NormProbe(Callback):
    """On the trained layout: the first attention's q_norm (sharded) on this rank's slice of a random input,
    its collectives per forward and backward, and how far it, a rank-local statistic (the wrong way) and its
    gradients are from the whole norm in one process."""

    def parity_extras(self, trainer):
        mesh = trainer.strategy.mesh.mesh["tp"]
        tp, rank = mesh.size(), mesh.get_local_rank()
        norm = trainer.lightning_module.model.model.layers[0].self_attn.q_norm
        weight = norm.weight.full_tensor().detach()
        torch.manual_seed(0)
        x = torch.randn(2, 8, weight.numel())
        grad_out = torch.randn_like(x)
        whole = x.clone().requires_grad_()
        expected = whole * torch.rsqrt(whole.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * weight
        expected.backward(grad_out)
        mine = slice(rank * weight.numel() // tp, (rank + 1) * weight.numel() // tp)
        local = x[..., mine].clone().requires_grad_()
        norm.weight.grad = None
        with CommDebugMode() as forward:
            out = norm(local)
        with CommDebugMode() as backward:
            out.backward(grad_out[..., mine])
        rank_local = local * torch.rsqrt(local.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * weight[mine]
        return {"norm": {
            "forward": {str(op): n for op, n in forward.get_comm_counts().items()},
            "backward": {str(op): n for op, n in backward.get_comm_counts().items()},
            "output": (out - expected[..., mine]).abs().max().item(),
            "input_grad": (local.grad - whole.grad[..., mine]).abs().max().item(),
            "weight_grad": (norm.weight.grad.full_tensor() - _weight_grad(x, grad_out, norm.variance_epsilon))
            .abs().max().item(),
            "rank_local_statistic": (rank_local - expected[..., mine]).abs().max().item(),
        }}


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor, eps: float) -> torch.Tensor:
    """The whole RMSNorm's weight gradient in one process."""
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * grad_out).sum((0, 1))


# ------------------------------------------------------------------------------------------ launches


@pytest.fixture(scope="module")
def two():
    return _launch(2, TWO + CLIP_VALUE_TWO, FAILING_TWO)


@pytest.fixture(scope="module")
def four():
    return _launch(4, FOUR + CLIP_VALUE_FOUR, {})


def _assert_parity(case: Case, got: dict) -> None:
    expected = reference(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got, metrics=("train_loss",))
    extras = got["extras"]
    assert extras["first_norm"] > CLIP["gradient_clip_val"], (case.name, extras["first_norm"])  # clipping acts
    if case.strategy.get("tp", 1) > 1:
        assert extras["local_numel"] < 0.7 * extras["numel"], (case.name, extras["local_numel"], extras["numel"])


@pytest.mark.parametrize("name", [case.name for case in TWO])
def test_two_processes_match_one(two, name):
    _assert_parity(ALL[name], two[0][name])


@pytest.mark.parametrize("name", [case.name for case in FOUR])
def test_four_processes_match_one(four, name):
    _assert_parity(ALL[name], four[0][name])


@pytest.mark.parametrize("case", CLIP_VALUE_TWO + CLIP_VALUE_FOUR, ids=lambda case: case.name)
def test_clipping_by_value_matches_one_process(two, four, case):
    got = (four if case in CLIP_VALUE_FOUR else two)[0][case.name]
    expected = reference(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got)
    unclipped = reference(replace(case, trainer={}))
    assert max_difference(unclipped, expected)[1] > 1e-3, "the bound does not clip: the test cannot fail"


@pytest.mark.parametrize("name", list(FAILING_TWO))
def test_errors_on_two_processes(two, name):
    assert_error(two[1][name], *FAILING_TWO[name][1:])


# ---------------------------------------------------------------------- 1. in-place into a tp output


def test_inplace_torch_style_fails_and_ours_matches_one_process(two, four):
    """The cause, on the trained layouts' tp groups: torch's row-wise style refuses ``y += 1`` on its output;
    with lightning_4d's output hook the same layer computes one process's output and weight gradient."""
    for name in ("inplace_tp2", "inplace_tp2_sp", "inplace_tp2_cp2"):
        found = (two[0] if name in two[0] else four[0])[name]["extras"]["inplace"]
        assert "Output 0 of _ToTorchTensor is a view and is being modified inplace" in found["torch"], (name, found)
        assert isinstance(found["ours"], float) and found["ours"] < 1e-6, (name, found)


def test_inplace_layers_are_sharded(two):
    """Parity cannot come from layers left whole: the projections the in-place arithmetic writes into are
    DTensor shards."""
    dtensors = two[0]["inplace_tp2"]["extras"]["dtensors"]
    for name in ("tok_emb.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.o_proj.weight",
                 "layers.0.mlp.down_proj.weight"):
        assert name in dtensors, (name, dtensors)


def test_own_tensor_is_no_view_and_keeps_autograd_checks():
    """Without a copy: the output shares the input's storage but is not a view, so it may be modified in place;
    a tensor autograd saved is still guarded by the shared version counter (a silent wrong gradient is not
    possible), and the gradient passes through unchanged."""
    a = torch.randn(4, requires_grad=True)
    b = a.exp()  # exp saves its output for backward
    c = _OwnTensor.apply(b)
    assert not c._is_view() and c.data_ptr() == b.data_ptr()
    c += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()
    d = _OwnTensor.apply(a * 2)
    d *= 3
    d.sum().backward()
    torch.testing.assert_close(a.grad, torch.full_like(a, 6.0))


# ------------------------------------------------------------ 2. a broadcast key/value head without enable_gqa


# (query, key, value, enable_gqa): every one accepted by torch's scaled_dot_product_attention on the CPU.
ACCEPTED = [
    ((2, 4, 8, 8), (2, 1, 8, 8), (2, 1, 8, 8), False),  # multi-query without enable_gqa: the pattern
    ((2, 1, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8), False),  # one query head, four key/value heads
    ((2, 4, 8, 8), (2, 1, 8, 8), (2, 4, 8, 8), False),  # key broadcast, value not
    ((2, 4, 8, 8), (1, 1, 8, 8), (1, 1, 8, 8), False),  # batch broadcast too
    ((4, 8, 8), (1, 8, 8), (1, 8, 8), False),  # three dims
    ((2, 3, 4, 8, 8), (2, 3, 1, 8, 8), (2, 3, 1, 8, 8), False),  # five dims
    ((2, 4, 8, 8), (2, 2, 8, 8), (2, 2, 8, 8), True),  # grouped-query attention
    ((2, 4, 8, 8), (2, 2, 8, 8), (2, 1, 8, 8), True),
    ((2, 6, 8, 8), (2, 2, 8, 8), (2, 3, 8, 8), True),
]
# ... and rejected by it: ring attention must reject them too, with torch's error.
REJECTED = [
    ((2, 4, 8, 8), (2, 2, 8, 8), (2, 2, 8, 8), False, "must match the size of tensor b (2) at non-singleton"),
    ((2, 4, 8, 8), (2, 4, 8, 8), (2, 2, 8, 8), False, "must match the size of tensor b (2) at non-singleton"),
    ((3, 4, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8), False, "must match the size of tensor b (2) at non-singleton"),
    ((2, 4, 8, 8), (2, 3, 8, 8), (2, 3, 8, 8), True, "Number of heads in key and value must divide"),
]


@pytest.mark.parametrize("shapes", ACCEPTED, ids=str)
def test_sdpa_operands_mean_what_torch_computes(shapes):
    """What ring attention gets (``[N, H, S, E]`` queries, key/value heads dividing ``H``, read in groups) is
    torch's attention for every shape torch accepts: the same output and gradients, computed here with torch's
    own kernel on the operands. A single broadcast key/value head stays one head (it travels round the ring
    once, not once per query head)."""
    *dims, gqa = shapes
    q, k, v = (torch.randn(*d, dtype=torch.float64, requires_grad=True) for d in dims)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    oq, ok, ov, lead = sdpa_operands(q, k, v, gqa)
    assert oq.dim() == ok.dim() == ov.dim() == 4 and oq.size(1) % ok.size(1) == 0 and ok.shape[:2] == ov.shape[:2]
    if k.size(-3) == v.size(-3) == 1:
        assert ok.size(1) == 1, ok.shape
    out = F.scaled_dot_product_attention(oq, ok, ov, is_causal=True, enable_gqa=True)
    got = out.reshape(*lead, *out.shape[2:])
    torch.testing.assert_close(got, expected)
    weights = torch.randn_like(expected)
    grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for mine, theirs in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)), grads):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("shapes", REJECTED, ids=str)
def test_sdpa_operands_reject_what_torch_rejects(shapes):
    *dims, gqa, phrase = shapes
    tensors = [torch.randn(*d) for d in dims]
    with pytest.raises(RuntimeError, match=re.escape(phrase)):
        F.scaled_dot_product_attention(*tensors, enable_gqa=gqa)
    with pytest.raises(RuntimeError, match=re.escape(phrase)):
        sdpa_operands(*tensors, gqa)


def test_broadcast_kv_plan_keeps_the_key_head_whole():
    """Under tp the query heads are split and the one key/value head stays whole on every rank (its gradients
    summed over tp): not a plan that keeps the attention whole."""
    plan = plan_tensor_parallel(BroadcastKVGPT(), 2)
    region = plan.regions["layers.0.attn"]
    assert (region.heads, region.kv_heads, region.kv_replicated) == (4, 1, True)
    assert plan.styles["layers.0.attn.q_proj"].style == "colwise"
    assert "layers.0.attn.k_proj" not in plan.styles and "layers.0.attn.v_proj" not in plan.styles
    assert "kv heads 1 < tp: k_proj, v_proj whole on every rank" in plan.describe()


# ------------------------------------------------------------------ 3. a norm over a whole q/k projection


def test_olmo2_plan_shards_its_attention():
    """Before: refused, with ``replicate`` as the fix. Now q_norm and k_norm are sharded with their projections
    and the plan shards 99% of the body (tp_strict's 90% holds)."""
    plan = plan_tensor_parallel(Olmo2LM(), 2)
    attention = "model.model.layers.0.self_attn"
    assert plan.regions[attention].projection_norms == ("q_norm", "k_norm")
    for name, style in (("q_proj", "colwise"), ("k_proj", "colwise"), ("q_norm", "sharded_norm"),
                        ("k_norm", "sharded_norm"), ("o_proj", "rowwise")):
        assert plan.styles[f"{attention}.{name}"].style == style, name
    assert plan.coverage.share >= 0.99, plan.coverage.describe()
    assert "q_norm, k_norm sharded with their projections" in plan.describe()


def test_olmo2_norm_is_recognised_as_rmsnorm():
    """The fast path (one all-reduce of ``[batch, seq, 1]``) only for what computes RMSNorm; a LayerNorm, or an
    RMSNorm whose eps differs from the attribute read, goes DTensor's generic way."""
    norm = Olmo2LM().model.model.layers[0].self_attn.q_norm
    assert rms_form(norm) == (norm.variance_epsilon, 0.0)
    assert rms_form(nn.LayerNorm(16)) is None

    class OtherEps(type(norm)):  # reads an eps of its own, not its attribute's
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3) * self.weight

    assert rms_form(OtherEps(16, eps=1e-6)) is None

    class Gemma(type(norm)):  # gain 1 + weight
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    assert rms_form(Gemma(16, eps=1e-6)) == (1e-6, 1.0)


def test_olmo2_norm_one_all_reduce_and_not_rank_local(two, four):
    """On the trained layouts: one all-reduce in forward and one in backward, output and gradients as the whole
    norm's in one process; a rank-local statistic (the wrong implementation) is far off."""
    for name in ("olmo2_tp2", "olmo2_tp2_sp", "olmo2_tp4", "olmo2_tp2_cp2"):
        probe = (two[0] if name in two[0] else four[0])[name]["extras"]["norm"]
        assert probe["forward"] == {"c10d.allreduce_": 1}, (name, probe)
        assert probe["backward"] == {"c10d.allreduce_": 1}, (name, probe)
        assert max(probe["output"], probe["input_grad"], probe["weight_grad"]) < 1e-5, (name, probe)
        assert probe["rank_local_statistic"] > 1e-2, (name, probe)
        dtensors = (two[0] if name in two[0] else four[0])[name]["extras"]["dtensors"]
        assert "model.model.layers.0.self_attn.q_norm.weight" in dtensors, dtensors


def test_layernorm_over_a_projection_is_sharded_the_generic_way(two):
    """A norm that is no RMSNorm (LayerNorm with a bias) runs its own forward on DTensors: sharded, at parity
    (test_two_processes_match_one[layernorm_qk_tp2])."""
    dtensors = two[0]["layernorm_qk_tp2"]["extras"]["dtensors"]
    for name in ("layers.0.attn.q_norm.weight", "layers.0.attn.q_norm.bias", "layers.0.attn.k_norm.weight"):
        assert name in dtensors, (name, dtensors)


def test_norm_over_key_heads_fewer_than_tp_is_refused():
    """With fewer key/value heads than tp each rank keeps only its key/value head: k_norm over the whole key
    projection cannot be computed there; refused before any collective, naming the module and the fix."""
    with pytest.raises(ValueError, match=r"self_attn.k_norm \(Olmo2RMSNorm\) normalizes the whole key projection"
                                         r" \(16 features\).*2 key/value heads, fewer than tp=4.*Fix: a"
                                         r" tensor-parallel size that divides 2"):
        plan_tensor_parallel(Olmo2LM(kv_heads=2), 4)


def test_sharded_norm_in_a_user_plan_needs_a_norm():
    with pytest.raises(ValueError, match="'sharded_norm' applies to a norm"):
        plan_tensor_parallel(Olmo2LM(), 2, {"model.model.layers.*.self_attn.q_proj": "sharded_norm"})
