"""lightning_4d's forward for nn.MultiheadAttention (``lightning_4d/modules/multihead_attention.py``) computes what
torch's does, outputs, attention weights (``need_weights=True``, averaged or per head) and gradients (fp32, 1e-6),
for every case it accepts; the cases it refuses say so. No processes: the tensor- and context-parallel runs are in
tests/test_zoo.py (torch_transformer and lightning_demo at tp2 and cp2) and tests/test_tp_strategy.py (a ViT
called with the defaults, and one that pools by the weights, at tp2 and dp2 x tp2)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_4d.modules.multihead_attention import MultiheadForwards, has_own_forward, install, unsupported

E, HEADS, B, L, S = 16, 4, 3, 5, 7
MASKS = ("none", "causal_float", "causal_bool", "is_causal", "key_padding", "key_padding_float",
         "causal_and_padding", "per_head_float")


def _causal(length: int, boolean: bool) -> torch.Tensor:
    mask = nn.Transformer.generate_square_subsequent_mask(length)
    return mask == float("-inf") if boolean else mask


def _masks(case: str, length: int, source: int, batch: int) -> dict:
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[0, -2:] = True
    padding[-1, -1] = True
    per_head = torch.randn(batch * HEADS, length, source, generator=torch.Generator().manual_seed(3))
    return {
        "none": {},
        "causal_float": {"attn_mask": _causal(length, False)},
        "causal_bool": {"attn_mask": _causal(length, True)},
        "is_causal": {"attn_mask": _causal(length, False), "is_causal": True},
        "key_padding": {"key_padding_mask": padding},
        "key_padding_float": {"key_padding_mask": torch.zeros(batch, source).masked_fill(padding, -1e4)},
        "causal_and_padding": {"attn_mask": _causal(length, True), "key_padding_mask": padding, "is_causal": True},
        "per_head_float": {"attn_mask": per_head},
    }[case]


def _pair(batch_first: bool = True, dropout: float = 0.0,
          split_sequence: bool = True) -> tuple[nn.MultiheadAttention, nn.MultiheadAttention]:
    """torch's module and a copy with lightning_4d's forward, as context parallelism installs it
    (``split_sequence``: the weights refused) or as tensor parallelism does."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=batch_first)
    nn.init.normal_(theirs.in_proj_bias)
    nn.init.normal_(theirs.out_proj.bias)
    ours = copy.deepcopy(theirs)
    MultiheadForwards([ours]) if split_sequence else install(ours)
    assert has_own_forward(ours) and not has_own_forward(theirs)
    return theirs, ours


def _run(module: nn.MultiheadAttention, query: torch.Tensor, memory: torch.Tensor | None, kwargs: dict,
         need_weights: bool = False):
    """Self-attention passes one tensor object thrice (as nn.TransformerEncoderLayer does), cross-attention
    the memory as key and value (as nn.TransformerDecoderLayer does). The gradients are of a loss that weighs
    every output (and weight) differently."""
    module.zero_grad()
    query = query.detach().clone().requires_grad_()
    memory = memory.detach().clone().requires_grad_() if memory is not None else None
    out, weights = module(query, memory if memory is not None else query, memory if memory is not None else query,
                          need_weights=need_weights, **kwargs)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    if weights is not None:
        loss = loss + (weights * torch.linspace(1, -2, weights.numel()).view_as(weights)).sum()
    loss.backward()
    return out, weights, query.grad, memory.grad if memory is not None else None, {
        name: p.grad.clone() for name, p in module.named_parameters()}


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-6 of the largest value (fp32 round-off of a different but equal order of operations)."""
    error = (got - expected).abs().max().item() / expected.abs().max().clamp_min(1e-12).item()
    assert error <= 1e-6, f"{what}: relative difference {error:.3g}"


def _assert_same(got, expected) -> None:
    _close(got[0], expected[0], "output")
    if expected[1] is None:
        assert got[1] is None
    else:
        assert got[1].shape == expected[1].shape
        _close(got[1], expected[1], "weights")
    for what, mine, torchs in zip(("query grad", "memory grad"), got[2:4], expected[2:4]):
        if torchs is not None:
            _close(mine, torchs, what)
    assert set(got[4]) == set(expected[4])
    for name in expected[4]:
        _close(got[4][name], expected[4][name], f"grad of {name}")


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("attention", ["self", "cross"])
@pytest.mark.parametrize("case", MASKS)
def test_forward_and_gradients_equal_torch(batch_first, attention, case):
    theirs, ours = _pair(batch_first)
    causal = case in ("causal_float", "causal_bool", "is_causal", "causal_and_padding")
    source = S if attention == "cross" and not causal else L  # a causal mask is square
    kwargs = _masks(case, L, source, B)
    shape = (lambda n: (B, n, E)) if batch_first else (lambda n: (n, B, E))
    x, memory = torch.randn(shape(L)), torch.randn(shape(source)) if attention == "cross" else None
    _assert_same(_run(ours, x, memory, kwargs), _run(theirs, x, memory, kwargs))


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("attention", ["self", "cross"])
@pytest.mark.parametrize("case", MASKS)
def test_weights_as_torch_returns_them(average, batch_first, attention, case):
    """``need_weights=True``, torch's default: the output, every head's weights (averaged or not) and the
    gradients of a loss that uses both, as torch's."""
    theirs, ours = _pair(batch_first, split_sequence=False)
    causal = case in ("causal_float", "causal_bool", "is_causal", "causal_and_padding")
    source = S if attention == "cross" and not causal else L
    kwargs = dict(_masks(case, L, source, B), average_attn_weights=average)
    shape = (lambda n: (B, n, E)) if batch_first else (lambda n: (n, B, E))
    x, memory = torch.randn(shape(L)), torch.randn(shape(source)) if attention == "cross" else None
    _assert_same(_run(ours, x, memory, kwargs, need_weights=True), _run(theirs, x, memory, kwargs, need_weights=True))


@pytest.mark.parametrize("case", ["none", "causal_float", "is_causal", "key_padding"])
def test_unbatched_input_equals_torch(case):
    theirs, ours = _pair()
    kwargs = _masks(case, L, L, 1)
    if "key_padding_mask" in kwargs:
        kwargs["key_padding_mask"] = kwargs["key_padding_mask"][0]
    x = torch.randn(L, E)
    _assert_same(_run(ours, x, None, kwargs), _run(theirs, x, None, kwargs))


def test_dropout_is_applied_in_training_and_off_in_eval():
    theirs, ours = _pair(dropout=0.5)
    x = torch.randn(B, L, E)
    torch.manual_seed(1)
    first = ours(x, x, x, need_weights=False)[0]
    torch.manual_seed(2)
    assert not torch.allclose(first, ours(x, x, x, need_weights=False)[0])
    theirs.eval(), ours.eval()
    _close(ours(x, x, x, need_weights=False)[0], theirs(x, x, x, need_weights=False)[0], "eval output")


def test_unbatched_weights_equal_torch():
    theirs, ours = _pair(split_sequence=False)
    x = torch.randn(L, E)
    _assert_same(_run(ours, x, None, {}, need_weights=True), _run(theirs, x, None, {}, need_weights=True))


def test_weights_under_a_split_sequence_and_a_causal_hint_without_mask_are_refused():
    _, ours = _pair()
    x = torch.randn(B, L, E)
    with pytest.raises(ValueError, match="need_weights=True.*under context parallelism.*need_weights=False"):
        ours(x, x, x)
    forwards = MultiheadForwards([ours])  # finds our forward installed; its remove takes the refusal off
    forwards.remove()
    assert ours(x, x, x)[1].shape == (B, L, L)
    with pytest.raises(RuntimeError, match="is_causal=True needs attn_mask"):
        ours(x, x, x, need_weights=False, is_causal=True)


@pytest.mark.parametrize(("kwargs", "what"), [
    (dict(add_bias_kv=True), "add_bias_kv=True"),
    (dict(add_zero_attn=True), "add_zero_attn=True"),
    (dict(kdim=8, vdim=8), "kdim=8/vdim=8 unlike embed_dim=16"),
])
def test_variants_it_does_not_compute_are_named(kwargs, what):
    module = nn.MultiheadAttention(E, HEADS, **kwargs)
    assert what in unsupported("layers.0.attn", module)
    assert unsupported("layers.0.attn", nn.MultiheadAttention(E, HEADS, bias=False)) is None


def test_the_forward_is_per_instance_invisible_and_removable():
    theirs, ours = _pair()
    names, state = [n for n, _ in theirs.named_modules()], set(theirs.state_dict())
    forwards = MultiheadForwards(nn.ModuleList([ours, theirs]).modules())
    assert forwards.installed == [theirs]  # ours has it already
    assert [n for n, _ in theirs.named_modules()] == names and set(theirs.state_dict()) == state
    assert type(theirs).forward is nn.MultiheadAttention.forward and has_own_forward(copy.deepcopy(theirs))
    forwards.remove()
    assert not has_own_forward(theirs) and "forward" not in theirs.__dict__ and has_own_forward(ours)
