"""Models built on the meta device (``trainer.init_module(empty_init=True)`` in ``configure_model``), against one
process, and the refusal of a module that nothing can initialize.

Parity (1e-5): the tiny Hugging Face Llama meta-built, with ``init_from`` a plain state_dict file of a whole-built
model's weights, under tp=2, dp_shard=2, pp=2, cp=2 (one 2-process launch) and tp2 x dp_shard2 (4 processes),
against one process that builds the model and loads the same file; and the same model built on the meta device
before ``fit`` and handed over (dp_shard=2). Under tp2 x dp_shard2 and dp2 x tp2 the same model with
its own initializer (Hugging Face's ``_init_weights``, one key/value head, so that k and v are random weights
every rank holds whole): every rank that holds the same shard of a parameter holds the same values, different
shards differ, the initializer's std is kept, and the rotary tables equal a freshly built rotary module's
(``to_empty`` would leave them garbage: they are non-persistent, no checkpoint holds them). A model with a
parameter that no initializer fills is refused on every rank, naming the module and ``init_from``.
"""

import math

import pytest
import torch

from tests.meta_models import Gain, whole_llama_state
from tests.parity import (Case, _references, assert_error, assert_parity, rank_tails, reference, report_difference,
                          run_layout, train_layout_with_failures)

LAUNCH_TIMEOUT_S = 400
META = dict(module="tests.meta_models:meta_llama", data="tests.lm_models:token_data", max_steps=3)
TWO_LAYOUTS = {"tp2": dict(tp=2), "dp_shard2": dict(dp_shard=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}
# dp2 x tp2: each tensor-parallel shard has a data-parallel replica holding random values
OWN_INIT = {"tp2_dp_shard2": dict(tp=2, dp_shard=2), "dp2_tp2": dict(dp=2, tp=2)}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("meta") / "whole.pt")
    whole_llama_state(path)
    return path


def _loaded(name: str, strategy: dict, weights: str) -> Case:
    return Case(f"meta_{name}", **META, strategy=dict(strategy, init_from=weights), module_kwargs={"weights": weights})


def _refused(name: str, strategy: dict) -> Case:
    return Case(name, module="tests.meta_models:no_initializer", data="tests.lm_models:token_data", max_steps=2,
                strategy=strategy)


def _handed_over(weights: str, meta: bool = True) -> Case:
    return Case("handed_over_dp_shard2", module="tests.meta_models:handed_over_llama", data="tests.lm_models:token_data",
                max_steps=3, strategy=dict(dp_shard=2, init_from=weights), module_kwargs={"weights": weights, "meta": meta})


@pytest.fixture(scope="module")
def two(weights):
    cases = [_loaded(name, strategy, weights) for name, strategy in TWO_LAYOUTS.items()] + [_handed_over(weights)]
    records, errors = train_layout_with_failures(cases, [_refused("refused_dp_shard2", dict(dp_shard=2))], 2,
                                                 timeout=LAUNCH_TIMEOUT_S)
    return cases, records, errors


@pytest.fixture(scope="module")
def four(weights):
    loaded = _loaded("tp2_dp_shard2", dict(tp=2, dp_shard=2), weights)
    own = [Case(f"own_init_{name}", **META, strategy=strategy, module_kwargs={"kv_heads": 1},
                callbacks=["tests.meta_models:InitProbe"]) for name, strategy in OWN_INIT.items()]
    result = run_layout([loaded, *own], 4, timeout=LAUNCH_TIMEOUT_S, while_running=lambda: _references([loaded]))
    assert all(code == 0 for code in result.returncodes), \
        f"ranks failed: {result.returncodes}\n{rank_tails(result.output)}"
    return loaded, result.results


def _assert_parity(case: Case, got: dict) -> None:
    expected = reference(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got)


@pytest.mark.parametrize("layout", list(TWO_LAYOUTS))
def test_meta_built_with_init_from_matches_one_process(two, layout):
    cases, records, _ = two
    case = next(c for c in cases if c.name == f"meta_{layout}")
    _assert_parity(case, records[case.name])


def test_model_handed_over_on_meta_matches_one_process(two, weights):
    _, records, _ = two
    got = records["handed_over_dp_shard2"]
    expected = reference(_handed_over(weights, meta=False))  # one process: built whole, then loaded
    report_difference(_handed_over(weights), expected, got)
    assert_parity(_handed_over(weights), expected, got)


def test_meta_built_with_init_from_matches_one_process_tp2_dp_shard2(four):
    case, records = four
    _assert_parity(case, records[case.name])


def test_module_without_initializer_is_refused_on_every_rank(two):
    _, _, errors = two
    assert_error(errors["refused_dp_shard2"], "ValueError",
                 ["built on the meta device", "body.0.1 (Gain: gain)", "body.1.1 (Gain: gain)", "reset_parameters()",
                  "init_from"])


@pytest.mark.parametrize("layout", list(OWN_INIT))
def test_own_initializer_gives_identical_replicas_and_true_rotary_tables(four, layout):
    _, records = four
    record = records[f"own_init_{layout}"]
    assert all(math.isfinite(loss) for loss in record["losses"]), record["losses"]
    ranks = record["extras"]["init_probe"]
    assert len(ranks) == 4
    for rank in ranks:  # recomputed, not to_empty's garbage
        assert rank["rotary"] == {"inv_freq": 0.0, "original_inv_freq": 0.0}, rank
    replicas_checked = distinct_checked = 0
    for name in ranks[0]["shards"]:
        by_shard: dict = {}
        for rank in ranks:
            key, local = rank["shards"][name]
            by_shard.setdefault(tuple(key), []).append((rank["rank"], local))
        for key, held in by_shard.items():
            for other_rank, other in held[1:]:
                assert torch.equal(held[0][1], other), f"{name}: shard {key} differs between ranks {held[0][0]} and {other_rank}"
                replicas_checked += 1
        firsts = [held[0][1] for held in by_shard.values()]
        if len(firsts) > 1 and firsts[0].std() > 0:  # random weights: each shard draws its own
            for i, a in enumerate(firsts):
                for b in firsts[i + 1:]:
                    assert a.shape != b.shape or not torch.equal(a, b), f"{name}: two different shards are equal"
                    distinct_checked += 1
    assert replicas_checked and distinct_checked
    # k/v are kept whole on every rank (one key/value head, tp=2): random, and identical on all four
    k_proj = [rank["shards"]["model.model.layers.0.self_attn.k_proj.weight"][1] for rank in ranks]
    assert k_proj[0].std() > 0 and all(torch.equal(k_proj[0], k) for k in k_proj[1:])
    q_proj = torch.cat([rank["shards"]["model.model.layers.0.self_attn.q_proj.weight"][1] for rank in ranks])
    assert abs(q_proj.std().item() - 0.02) < 0.004  # Hugging Face's initializer_range


# ------------------------------------------------------------------------ the refusal, without processes


class _Tables(torch.nn.Module):
    """Non-persistent rotary-like tables and no initializer: no checkpoint holds them, nothing recomputes them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos", torch.arange(4.0).cos(), persistent=False)


def test_refusal_names_what_init_from_cannot_fill():
    import transformers

    from lightning_4d.composition.materialize import check_initializers
    from tests.meta_models import llama_config

    with torch.device("meta"):
        gain, tables = torch.nn.Sequential(torch.nn.Linear(2, 2), Gain(2)), _Tables()
    check_initializers(gain, loading=True)  # init_from fills the gain
    with pytest.raises(ValueError, match=r"1 \(Gain: gain\).*reset_parameters\(\).*init_from"):
        check_initializers(gain)
    with pytest.raises(ValueError, match=r"non-persistent buffers.*\(the module itself\) \(_Tables: cos\)"):
        check_initializers(tables, loading=True)
    with torch.device("meta"):  # Hugging Face's _init_weights covers every module, rotary tables included
        check_initializers(transformers.LlamaForCausalLM(llama_config()))


# ------------------------------------------------------------------- initializers, in one process


class _TitanLike(torch.nn.Module):
    """torchtitan's protocol: the model's init_weights(buffer_device) fills everything below it (its norm has no
    reset_parameters of its own) and recomputes its tables."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.scale = Gain(4)
        self.register_buffer("table", torch.arange(4.0).sin(), persistent=False)

    def init_weights(self, buffer_device=None):
        torch.nn.init.trunc_normal_(self.proj.weight, std=0.5)
        torch.nn.init.ones_(self.scale.gain)
        self.table = torch.arange(4.0, device=buffer_device).sin()


def _materialized(build, seed: int = 3):
    from lightning_4d.composition.materialize import check_initializers, initialize, materialize

    with torch.device("meta"):
        module = build()
    check_initializers(module)
    initialize(module, materialize(module, torch.device("cpu")), torch.device("cpu"), seed)
    return module


def test_torchtitan_reset_parameters_and_hugging_face_initializers_fill_everything():
    import transformers

    from tests.meta_models import llama_config

    state = torch.random.get_rng_state()
    titan = _materialized(_TitanLike)
    assert torch.equal(titan.table, torch.arange(4.0).sin()) and torch.equal(titan.scale.gain, torch.ones(4))
    assert 0 < titan.proj.weight.std() and titan.proj.weight.abs().max() <= 2.0  # trunc_normal_ cuts at +-2
    plain = _materialized(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    assert plain[0].weight.abs().max() <= 8 ** -0.5 and torch.equal(plain[1].weight, torch.ones(8))
    llama = _materialized(lambda: transformers.LlamaForCausalLM(llama_config()))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is left as it was
    fresh = transformers.LlamaForCausalLM(llama_config())
    for name, value in (*llama.named_parameters(), *llama.named_buffers()):
        assert not value.isnan().any(), name
    assert torch.equal(llama.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    assert abs(llama.model.embed_tokens.weight.std().item() - 0.02) < 0.004
    # each tensor's values follow from the seed and its name only: the same in another build, other per name
    again = _materialized(lambda: transformers.LlamaForCausalLM(llama_config()))
    assert all(torch.equal(a, b) for a, b in zip(llama.parameters(), again.parameters()))
    assert not torch.equal(llama.model.layers[0].mlp.up_proj.weight, llama.model.layers[1].mlp.up_proj.weight)
