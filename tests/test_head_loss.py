"""The LM head fused with its cross entropy (issue #39): logits that never exist whole, the same numbers.

In-process: every loss chain people write (``view``/``reshape``/``float``/slicing/boolean masks, cross entropy
with ``ignore_index``, class weights, label smoothing and each reduction, ``nll_loss(log_softmax(...))``) gives
the unfused loss and gradients within fp32 round-off (1e-6 relative), also under bf16 autocast (compared with
the unfused bf16 path), with the gradients formed in forward or in backward, and no tensor of the step holds more
than a chunk of logits (the unfused step does: so the test can fail); formed in backward, the forward keeps no
gradient for it. Other uses get the logits whole; in-place changes and use after the step are refused.

Multi-process (``tests/parity.py``): Hugging Face Llama and Qwen2 with ``labels=`` and with the explicit cross
entropy, a nanoGPT head tied to its embedding, litgpt's and torchtitan's heads, on one device, dp=2, cp=2,
pp=2 (1F1B and GPipe, whose last stage forms the head's gradients in backward), dp_shard=2, tp=2 and dp2 x pp2 x
cp2, against one unfused process: per-step loss, logged metrics and
final weights within 1e-5 (fp32, SGD), with activation checkpointing and compile too. A probe counts the
chunked cross entropies on every rank, so a case that silently fell back fails; under tp each rank computes its
share of the vocabulary (with class weights, label smoothing and an accuracy beside).
"""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.head_placement import MadeTensors
from lightning_4d.numerics import head_loss
from tests.parity import Case, assert_parity, reference, report_difference, train_layout

V, H = 50, 8


class _Toy(nn.Module):
    def __init__(self, tied: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=bias)
        if tied:
            self.lm_head.weight = self.emb.weight

    def forward(self, x):
        return self.lm_head(torch.tanh(self.body(self.emb(x))))


CHAINS = {
    "view": lambda l, y: F.cross_entropy(l.view(-1, V), y.view(-1)),
    "shift_reshape_float": lambda l, y: F.cross_entropy(l[:, :-1, :].reshape(-1, l.size(-1)).float(),
                                                        y[:, 1:].reshape(-1)),
    "contiguous_flatten": lambda l, y: F.cross_entropy(l.contiguous().flatten(0, 1), y.flatten()),
    "smoothing": lambda l, y: F.cross_entropy(l.view(-1, V), y.view(-1), label_smoothing=0.1, ignore_index=-100),
    "class_weights": lambda l, y: F.cross_entropy(l.view(-1, V), y.view(-1), weight=torch.linspace(0.5, 2, V)),
    "sum_scaled": lambda l, y: F.cross_entropy(l.flatten(0, 1), y.flatten(), reduction="sum") * 0.3,
    "none_weighted": lambda l, y: (F.cross_entropy(l.view(-1, V), y.view(-1), reduction="none")
                                   * torch.arange(33.0)).sum(),
    "nll_log_softmax": lambda l, y: F.nll_loss(F.log_softmax(l.float(), dim=-1).view(-1, V), y.view(-1)),
    "boolean_mask": lambda l, y: F.cross_entropy(l[y != -100], y[y != -100]),
    "last_token": lambda l, y: F.cross_entropy(l[:, -1], y[:, -1]),
    "to_dtype": lambda l, y: F.cross_entropy(l.to(torch.float32).view(-1, V), y.view(-1)),
    "temperature_softcap": lambda l, y: F.cross_entropy((torch.tanh(l / 3.0) * 3.0 + torch.linspace(0, 1, V))
                                                        .view(-1, V), y.view(-1)),
    "in_place": lambda l, y: F.cross_entropy(_changed_in_place(l).view(-1, V), y.view(-1)),
}


def _changed_in_place(logits):
    """What library code does to its logits in place: scale, bias, suppress tokens, assign a column."""
    logits *= 2.0
    logits.add_(torch.linspace(-1.0, 1.0, V))
    logits.masked_fill_(torch.arange(V) % 7 == 0, -2.0)
    logits[..., 3] = -1.0
    logits.clamp_(max=4.0)
    return logits


def _run(fused: bool, chain, *, tied=False, bias=False, chunk_tokens=7, autocast=False, seed=0, in_backward=False):
    torch.manual_seed(seed)
    model = _Toy(tied, bias)
    x, y = torch.randint(0, V, (3, 11)), torch.randint(0, V, (3, 11))
    y[0, :4] = -100
    owner = head_loss.ChunkedHeadLoss("lm_head", model.lm_head, chunk_tokens * V) if fused else None
    if owner is not None:
        owner.gradients_in_backward = in_backward
    with head_loss.step_scope(owner), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = chain(model(x), y)
        loss.backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}, owner


@pytest.mark.parametrize("in_backward", [False, True], ids=["gradients_in_forward", "gradients_in_backward"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(CHAINS))
def test_a_chain_to_the_loss_gives_the_unfused_numbers(name, tied, in_backward):
    expected, expected_grads, _ = _run(False, CHAINS[name], tied=tied, bias=not tied)
    got, grads, owner = _run(True, CHAINS[name], tied=tied, bias=not tied, in_backward=in_backward)
    assert (owner.fused, owner.fallbacks) == (1, 0), (owner.fused, owner.fallbacks)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for n in expected_grads:
        # Round-off is relative to the gradient's scale (up to 280 under none_weighted's weights up to 32): a small
        # element of a large gradient differs by an ulp of the large ones when the summation order changes
        # (two intra-op threads instead of one: 5.7e-6 in emb.weight, whose largest element is 38).
        scale = max(1.0, expected_grads[n].abs().max().item())
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-6, atol=1e-6 * scale,
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("in_backward", [False, True], ids=["gradients_in_forward", "gradients_in_backward"])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 33, 1000])
def test_any_chunk_size_gives_the_unfused_numbers(chunk_tokens, in_backward):
    expected, expected_grads, _ = _run(False, CHAINS["smoothing"])
    got, grads, _ = _run(True, CHAINS["smoothing"], chunk_tokens=chunk_tokens, in_backward=in_backward)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for n in expected_grads:
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("in_backward", [False, True], ids=["gradients_in_forward", "gradients_in_backward"])
def test_bf16_autocast_computes_as_the_unfused_path(in_backward):
    """Each chunk runs the unfused path's ops under the same autocast (bf16 logits, the cast, an fp32 loss): the
    loss agrees to fp32 round-off; a weight gradient is a sum of per-chunk bf16 products instead of one, so it
    and backward's scale is applied after the bf16 products instead of before, so each gradient is checked to be
    as close to the fp32 gradient as the unfused bf16 one is: relative error norms within 2x."""
    expected, expected_grads, _ = _run(False, CHAINS["shift_reshape_float"], autocast=True)
    got, grads, _ = _run(True, CHAINS["shift_reshape_float"], autocast=True, in_backward=in_backward)
    _, exact, _ = _run(False, CHAINS["shift_reshape_float"])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for n in expected_grads:
        unfused_error = ((expected_grads[n] - exact[n]).norm() / exact[n].norm()).item()
        fused_error = ((grads[n] - exact[n]).norm() / exact[n].norm()).item()
        assert fused_error <= 2 * unfused_error + 1e-7, (n, fused_error, unfused_error)


def test_a_small_head_runs_as_written_only_under_a_forwards_first_schedule():
    """GPipe with 4 micro-batches: a plain head's logits (10 tokens x V) are computed whole while the four
    micro-batches' fit in one chunk (MIN_CHUNK_ELEMENTS), deferred past that and under 1F1B."""
    model = _Toy()
    owner = head_loss.install(model, "lm_head")
    x = torch.randint(0, V, (2, 5))
    for forwards_first, whole in ((True, head_loss.MIN_CHUNK_ELEMENTS // 4), (False, 0)):
        owner.schedule(forwards_first, 4)
        assert (owner.gradients_in_backward, owner.whole_elements) == (forwards_first, whole)
        with head_loss.step_scope(owner):
            assert (type(model(x)) is torch.Tensor) == forwards_first
    owner.schedule(True, head_loss.MIN_CHUNK_ELEMENTS // (10 * V) + 1)  # the micro-batches' logits: past a chunk
    with head_loss.step_scope(owner):
        assert isinstance(model(x), head_loss.DeferredLogits)
    assert "at most 1,048,576 elements are computed whole" in head_loss.describe("lm_head", model, False, 2**20)
    assert "computed whole" not in head_loss.describe("lm_head", model, True, 2**20)  # a tensor-parallel head


class _Largest(TorchDispatchMode):
    """The largest tensor any op of the step produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.stride() and 0 not in t.stride():
                self.largest = max(self.largest, t.numel())
        return out


def test_the_logits_never_exist_whole():
    """Forward and backward of a 3 x 11 token step: no tensor over a chunk's 7 x V logits or the head's V x H
    weight gradient when fused; the unfused step makes the 30 x V shifted logits (so the probe sees them)."""
    largest = {}
    for fused in (False, True):
        with _Largest() as probe:
            _run(fused, CHAINS["shift_reshape_float"])
        largest[fused] = probe.largest
    assert largest[False] >= 30 * V and largest[True] <= max(7 * V, V * H), largest


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_formed_in_backward_keep_nothing_from_the_forward(reduction):
    """What GPipe's last stage needs, which runs every micro-batch's forward before any backward: formed in
    forward, each micro-batch's loss keeps the head's weight gradient (V x H) and its rows' until backward;
    formed in backward (``gradients_in_backward``), the forward keeps nothing but its inputs (views of them) and
    a mean's token count, and backward then gives the same gradients as the unfused step."""
    kept = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = _Toy()
        x, y = torch.randint(0, V, (3, 11)), torch.randint(0, V, (3, 11))
        owner = head_loss.ChunkedHeadLoss("lm_head", model.lm_head, 7 * V)
        owner.gradients_in_backward = in_backward
        with head_loss.step_scope(owner):
            hidden = torch.tanh(model.body(model.emb(x))).detach().requires_grad_()
            with MadeTensors() as probe:
                loss = F.cross_entropy(model.lm_head(hidden).view(-1, V), y.view(-1), reduction=reduction)
            gc.collect()
            inputs = {hidden.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
            kept[in_backward] = sorted(tuple(t.shape) for t in (ref() for ref in probe.made) if t is not None
                                       and t is not loss and t.untyped_storage().data_ptr() not in inputs)
            loss.backward()
        torch.testing.assert_close(model.lm_head.weight.grad, _unfused_head_grad(model, hidden, y, reduction),
                                   rtol=1e-6, atol=1e-7)
    assert (V, H) in kept[False] and (33, H) in kept[False], kept
    assert all(shape == () for shape in kept[True]), kept  # a mean's token count at most


def _unfused_head_grad(model, hidden, y, reduction):
    weight = model.lm_head.weight.detach().requires_grad_()
    F.cross_entropy(F.linear(hidden.detach(), weight).view(-1, V), y.view(-1), reduction=reduction).backward()
    return weight.grad


def test_other_uses_get_the_logits_whole_and_say_so_once():
    torch.manual_seed(0)
    model = _Toy()
    x = torch.randint(0, V, (2, 5))
    expected = model(x)
    owner = head_loss.install(model, "lm_head")
    with pytest.warns(UserWarning, match="computed whole for .*argmax"), head_loss.step_scope(owner) as materialized:
        logits = model(x)
        assert isinstance(logits, head_loss.DeferredLogits) and logits.shape == (2, 5, V)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        torch.testing.assert_close(logits.softmax(-1), expected.softmax(-1))
        returned = materialized({"loss": logits.sum(), "logits": logits})
        assert type(returned["logits"]) is torch.Tensor
        torch.testing.assert_close(returned["logits"], expected)
    assert owner.fallbacks == 3


def test_in_place_changes_per_token_and_use_after_the_step_are_refused():
    model = _Toy()
    owner = head_loss.install(model, "lm_head")
    with head_loss.step_scope(owner):
        logits = model(torch.randint(0, V, (2, 5)))
        with pytest.raises(RuntimeError, match=r"masked_fill_ changes the LM head lm_head's logits in place.*"
                                               r"out-of-place form"):
            logits.masked_fill_(torch.rand(2, 5, 1) > 0.5, 0.0)  # a mask that varies by token
        with pytest.raises(RuntimeError, match="__setitem__ changes .* in place"):
            logits[0, 0] = 1.0  # one token's row
        shifted = logits[:, :-1]
        with pytest.raises(RuntimeError, match="before anything else is derived"):
            logits.div_(2.0)  # shifted, derived before, would miss it
        assert shifted.shape == (2, 4, V)
    with pytest.raises(RuntimeError, match=r"used after the step.*return them from the step"):
        logits.sum()
    outside = model(torch.randint(0, V, (2, 5)))  # outside a step the head is the plain nn.Linear
    assert type(outside) is torch.Tensor


def test_the_lm_head_is_found_in_every_library_layout():
    from tests.lm_models import NanoGPT
    from tests.zoo_models import zoo_lm

    assert head_loss.find_lm_head(NanoGPT()) == "lm_head"
    assert head_loss.find_lm_head(zoo_lm("qwen2")) == "model.lm_head"
    assert head_loss.find_lm_head(zoo_lm("litgpt_llama")) == "model.lm_head"
    assert head_loss.find_lm_head(zoo_lm("torchtitan_llama3")) == "model.lm_head"
    assert head_loss.find_lm_head(nn.Sequential(nn.Linear(4, 4))) is None


def test_fuse_lm_loss_must_be_a_bool():
    from lightning_4d import FourDStrategy

    with pytest.raises(ValueError, match=r"fuse_lm_loss='yes': use True"):
        FourDStrategy(fuse_lm_loss="yes")


# ------------------------------------------------------------------------------------------ layouts

PROBE = ["tests.head_loss_models:FusedHeadCount"]
SFT = dict(data="tests.fine_tuning_models:sft_data", max_steps=3, callbacks=PROBE)
LLAMA, QWEN = {"family": "llama"}, {"family": "qwen2"}
ZOO = "tests.zoo_models:HFZooLM"
LABELS, SMOOTHED = "tests.head_loss_models:LabelsLM", "tests.head_loss_models:SmoothedLM"
ONE = [
    Case("llama_labels_one_device", module=LABELS, module_kwargs=LLAMA, **SFT),
    Case("nanogpt_tied_one_device", module="tests.lm_models:NanoGPT", **SFT),
]
TWO = [
    Case("llama_ce_dp2", module=ZOO, module_kwargs=LLAMA, strategy={"dp": 2}, **SFT),
    Case("llama_labels_cp2", module=LABELS, module_kwargs=LLAMA, strategy={"cp": 2}, **SFT),
    Case("qwen2_labels_dp_shard2", module=LABELS, module_kwargs=QWEN, strategy={"dp_shard": 2}, **SFT),
    Case("qwen2_ce_pp2", module=ZOO, module_kwargs=QWEN, strategy={"pp": 2}, **SFT),
    # GPipe: every micro-batch's forward before any backward, so the head forms its gradients in backward; a
    # head this small runs as written there unless told otherwise (ChunkedEvenWhenSmall)
    Case("qwen2_ce_pp2_gpipe", module=ZOO, module_kwargs=QWEN, strategy={"pp": 2, "pp_schedule": "gpipe"},
         **dict(SFT, callbacks=PROBE + ["tests.head_loss_models:ChunkedEvenWhenSmall"])),
    Case("qwen2_ce_pp2_gpipe_small_head", module=ZOO, module_kwargs=QWEN,
         strategy={"pp": 2, "pp_schedule": "gpipe"}, **SFT),
    Case("nanogpt_tied_cp2", module="tests.lm_models:NanoGPT", strategy={"cp": 2}, **SFT),
    Case("nanogpt_tied_dp_shard2", module="tests.lm_models:NanoGPT", strategy={"dp_shard": 2}, **SFT),
    # the head an FSDP unit of its own, kept gathered from its forward to its backward
    Case("qwen2_labels_dp_shard2_modules", module=LABELS, module_kwargs=QWEN,
         strategy={"dp_shard": 2, "shard_units": "modules"}, **SFT),
    # a root unit that frees the head's gathered weight after the forward: not fused, said at start-up
    Case("llama_labels_dp_shard2_reshard", module=LABELS, module_kwargs=LLAMA,
         strategy={"dp_shard": 2, "reshard_after_forward": True}, **SFT),
    Case("litgpt_pp2", module="tests.head_loss_models:library_lm", module_kwargs={"family": "litgpt_llama"},
         strategy={"pp": 2}, **SFT),
    Case("torchtitan_dp2", module="tests.head_loss_models:library_lm", module_kwargs={"family": "torchtitan_llama3"},
         strategy={"dp": 2}, **SFT),
    Case("shifted_pp2", module="tests.head_loss_models:ShiftedLM", module_kwargs=LLAMA, strategy={"pp": 2}, **SFT),
    Case("smoothed_dp_shard2", module=SMOOTHED, module_kwargs=LLAMA, strategy={"dp_shard": 2}, **SFT),
    Case("smoothed_cp2", module=SMOOTHED, module_kwargs=QWEN, strategy={"cp": 2}, **SFT),
    Case("accuracy_cp2", module="tests.head_loss_models:AccuracyLM", module_kwargs=LLAMA, strategy={"cp": 2},
         **SFT),
    Case("llama_labels_tp2", module=LABELS, module_kwargs=LLAMA, strategy={"tp": 2}, **SFT),
    Case("smoothed_tp2", module=SMOOTHED, module_kwargs=QWEN, strategy={"tp": 2}, **SFT),
    Case("weighted_nll_tp2", module="tests.fine_tuning_models:WeightedLossLM", strategy={"tp": 2}, **SFT),
    Case("accuracy_tp2", module="tests.head_loss_models:AccuracyLM", module_kwargs=LLAMA, strategy={"tp": 2},
         **SFT),
    Case("llama_labels_dp2_checkpointed", module=LABELS, module_kwargs=LLAMA,
         strategy={"dp": 2, "activation_checkpointing": "full"}, **SFT),
    # blocks compiled by dynamo and AOT autograd, the head outside them (inductor's code: tests/test_compile.py)
    Case("llama_ce_cp2_compiled", module=ZOO, module_kwargs=LLAMA,
         strategy={"cp": 2, "compile": {"backend": "aot_eager"}}, **SFT),
    Case("llama_unfused_dp2", module=LABELS, module_kwargs=LLAMA, strategy={"dp": 2, "fuse_lm_loss": False}, **SFT),
]
EIGHT = [Case("llama_labels_dp2_pp2_cp2", module=LABELS, module_kwargs=LLAMA, strategy={"dp": 2, "pp": 2, "cp": 2},
              **SFT)]
CASES = {c.name: c for c in ONE + TWO + EIGHT}
# no chunked cross entropy expected
NOT_FUSED = {"llama_unfused_dp2", "llama_labels_dp_shard2_reshard", "qwen2_ce_pp2_gpipe_small_head"}


@pytest.fixture(scope="module")
def layouts():
    records = {}
    for cases, world in ((ONE, 1), (TWO, 2), (EIGHT, 8)):
        records.update(train_layout(cases, world, timeout=600))
    return records


@pytest.mark.parametrize("name", list(CASES))
def test_a_layout_with_the_fused_head_matches_one_unfused_process(layouts, name):
    case, got = CASES[name], layouts[name]
    expected = reference(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got, metrics=("train_loss", "accuracy") if "accuracy" in name else ("train_loss",))
    extras = got["extras"]
    if name in NOT_FUSED:
        assert extras["fused"] == 0, extras
        if name == "qwen2_ce_pp2_gpipe_small_head":  # installed on the last stage, and left as written by the rule
            assert (extras["fused_heads"], extras["gradients_in_backward"]) == (1, 1), extras
        return
    # one chunked cross entropy per step (per micro-batch under pp, on its last stage), on every rank that
    # holds the head; an accuracy's argmax is the only use that computed the logits whole
    assert extras["fused_heads"] >= 1 and extras["fused"] >= case.max_steps, extras
    assert extras["gradients_in_backward"] == (extras["fused_heads"] if "gpipe" in name else 0), extras
    if "accuracy" in name:
        assert extras["fallbacks"] >= case.max_steps, extras
    else:
        assert extras["fallbacks"] == 0, extras
