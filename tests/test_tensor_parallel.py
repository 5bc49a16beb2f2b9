"""Tensor, sequence and vocabulary parallelism of unchanged modules against the single-process module.

One spawn of tp=2 ranks (and one of tp=4) runs every case in turn on CPU/gloo; each rank writes its
measurements to a JSON file and the parent asserts them per case, on every rank. Plan errors are in
tests/test_bad_inputs.py.
"""

from __future__ import annotations

import copy
import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_4d.numerics.clipping import clip_grad_norm_
from lightning_4d.tensor_parallel import (
    TensorParallelCheckError,
    apply_tensor_parallel,
    plan_tensor_parallel,
    tensor_parallel_context,
)
from tests import tp_models as M
from tests.models import Classifier
from tests.parity import free_port, spawn

TOL = 1e-5
VOCAB, B, T = 64, 2, 8
LAUNCH_TIMEOUT_S = 240


# --------------------------------------------------------------------------- models


def _hf(kind: str, tp: int) -> nn.Module:
    import transformers

    if kind == "hf_gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if kind.startswith("hf_bigcode"):  # multi-query (one key/value head), or with _mha q, k, v head by head
        config = transformers.GPTBigCodeConfig(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, multi_query=kind == "hf_bigcode",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=1,
        )  # fmt: skip
        return transformers.GPTBigCodeForCausalLM(config)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2 if tp == 2 else 4, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    if kind == "hf_qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def _torchtitan(fused: bool = True) -> nn.Module:
    """torchtitan's Llama3Model (4 heads, 2 key/value heads), its q, k, v one level down in ``qkv_linear``: fused
    by key/value group in ``wqkv``, or (``fused=False``) in ``wq``, ``wk``, ``wv``."""
    from functools import partial

    from torchtitan.models.common.config_utils import make_gqa_config

    from tests.zoo_models import _torchtitan_llama3_config

    config = _torchtitan_llama3_config()
    if not fused:
        init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
        for layer in config.layers:
            attention = layer.attention
            layer.attention = make_gqa_config(
                dim=32, n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads, wqkv_param_init=init,
                wo_param_init=init, inner_attention=attention.inner_attention, rope=attention.rope)
    model = config.build()
    model.init_states()
    return model


def _example_gpt() -> nn.Module:
    from lightning_4d.demos.gpt import GPT

    return GPT(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=16, tie_weights=True).model


BUILDERS = {
    "tinygpt": lambda tp: M.TinyGPT(VOCAB),
    "example_gpt": lambda tp: _example_gpt(),
    "nanogpt": lambda tp: M.NanoGPT(VOCAB),
    "litgpt": lambda tp: M.LitGPT(M.LitConfig(VOCAB, n_query_groups=2 if tp == 2 else 4)),
    "meta_llama": lambda tp: M.MetaLlama(VOCAB, n_kv_heads=2 if tp == 2 else 4),
    "hf_llama": lambda tp: _hf("hf_llama", tp),
    "hf_gpt2": lambda tp: _hf("hf_gpt2", tp),
    "hf_qwen3": lambda tp: _hf("hf_qwen3", tp),
    "hf_bigcode": lambda tp: _hf("hf_bigcode", tp),
    "hf_bigcode_mha": lambda tp: _hf("hf_bigcode_mha", tp),
    "torchtitan": lambda tp: _torchtitan(),
    "torchtitan_unfused": lambda tp: _torchtitan(fused=False),
    "encoder": lambda tp: M.TorchEncoder(VOCAB),
    "custom_heads": lambda tp: M.TinyGPT(VOCAB, attention=M.CustomHeadsAttention),
}
FAMILIES = ("tinygpt", "example_gpt", "nanogpt", "litgpt", "meta_llama", "hf_llama", "hf_gpt2", "hf_qwen3",
            "hf_bigcode", "torchtitan")


# --------------------------------------------------------------------------- worker side


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _forward_loss(family: str, model: nn.Module, idx: torch.Tensor, y: torch.Tensor):
    """(logits, loss, accuracy or None) the way each code base computes its loss."""
    if family == "nanogpt":
        logits, loss = model(idx, y)
        return logits, loss, None
    if family.startswith("hf_"):
        out = model(input_ids=idx, labels=idx)
        return out.logits, out.loss, None
    if family == "encoder":
        out = model(idx)
        return out, out.pow(2).mean(), None
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    accuracy = (logits.argmax(-1) == y).float().mean()  # a non-loss use of the logits: gathered transparently
    return logits, loss, accuracy


def _unpermuted_grads(model: nn.Module, plan) -> dict[str, torch.Tensor]:
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    for fqn, region in plan.regions.items():
        if region.fused is not None:
            prefix = f"{fqn}.{region.inputs[0]}."
            grads[prefix + "weight"] = region.fused.to_original(
                grads[prefix + "weight"], plan.tp_size, region.fused.dim
            )
            if prefix + "bias" in grads:
                grads[prefix + "bias"] = region.fused.to_original(grads[prefix + "bias"], plan.tp_size, 0)
    return grads


def _ties(model: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((x.float() - b[k].float()).abs().max().item() for k, x in a.items())


def _plain_forward(family: str, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Outside tensor_parallel_context, as callbacks or generation would call the model."""
    if family.startswith("hf_"):
        return model(input_ids=idx).logits
    out = model(idx)
    return out[0] if isinstance(out, tuple) else out


def _parity(family: str, mesh, sp: bool = False, tp_plan="auto") -> dict:
    tp = mesh.size()
    torch.manual_seed(0)
    model = BUILDERS[family](tp)
    ref = copy.deepcopy(model)
    idx, y = torch.randint(0, VOCAB, (B, T)), torch.randint(0, VOCAB, (B, T))
    full_numel = sum(p.numel() for p in model.parameters())

    plan = plan_tensor_parallel(model, tp, tp_plan, sequence_parallel=sp)
    check = apply_tensor_parallel(model, mesh, plan)
    check.arm()
    with tensor_parallel_context(plan):
        logits, loss, accuracy = _forward_loss(family, model, idx, y)
        logits_type = type(logits).__name__
        full_logits = _full(logits).detach()
    check_errors = check.verify()
    with tensor_parallel_context(plan):
        loss.backward()
    ref_logits, ref_loss, ref_accuracy = _forward_loss(family, ref, idx, y)
    ref_loss.backward()

    result = {
        "logits_type_in_context": logits_type,
        "loss_type": type(loss).__name__,
        "out_err": (full_logits - ref_logits.detach()).abs().max().item(),
        "loss_err": abs(loss.item() - ref_loss.item()),
        "grad_err": _max_err(_unpermuted_grads(model, plan), {n: p.grad for n, p in ref.named_parameters()}),
        "check_err": max(check_errors.values()),
        "checked": sorted(check_errors),
        "local_numel_ratio": sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()) / full_numel,
        "ties": _ties(ref),
        "tp_ties": _ties(model),
        "loss_parallel": plan.loss_parallel,
    }
    if accuracy is not None:
        result["accuracy_err"] = abs(accuracy.item() - ref_accuracy.item())
        result["accuracy_type"] = type(accuracy).__name__
    norm = clip_grad_norm_(model.parameters(), 0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    result["clip_norm_err"] = abs(norm.item() - ref_norm.item())
    result["clipped_grad_err"] = _max_err(
        _unpermuted_grads(model, plan), {n: p.grad for n, p in ref.named_parameters()}
    )
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    state = {k: _full(v) for k, v in model.state_dict().items()}
    result["step_err"] = _max_err(state, ref.state_dict())
    with torch.no_grad():
        outside, ref_out = _plain_forward(family, model, idx), _plain_forward(family, ref, idx)
    result["logits_type_outside"] = type(outside).__name__
    result["after_step_out_err"] = (outside - ref_out).abs().max().item()
    if any(r.fused is not None for r in plan.regions.values()):
        saved = {k: v.clone() for k, v in model.state_dict().items()}  # values alias the parameters
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(saved)
        with torch.no_grad():
            again = _plain_forward(family, model, idx)
        result["reload_err"] = (again - ref_out).abs().max().item()
    return result


def _pipeline_stage(mesh, held) -> dict:
    """A plan made on the whole model, applied to a middle stage holding only some of its blocks (named by
    ``held`` as the pipeline plan names them)."""
    torch.manual_seed(0)
    model = M.TinyGPT(VOCAB, n_layer=3)
    plan = plan_tensor_parallel(model, mesh.size(), sequence_parallel=True)
    model.tok_emb, model.layers[2], model.norm, model.lm_head = nn.Identity(), nn.Identity(), nn.Identity(), nn.Identity()
    ref = copy.deepcopy(model)
    check = apply_tensor_parallel(model, mesh, plan, held=held)
    x = torch.randn(B, T, 32)
    check.arm()
    with tensor_parallel_context(plan):
        out = model(x)
        out.square().mean().backward()
    ref_out = ref(x)
    ref_out.square().mean().backward()
    return {
        "out_err": (_full(out) - ref_out).abs().max().item(),
        "grad_err": _max_err(_unpermuted_grads(model, plan), {n: p.grad for n, p in ref.named_parameters()}),
        "checked": sorted(check.verify()),
    }


def _wrong_head_count(mesh) -> dict:
    torch.manual_seed(0)
    model = M.TinyGPT(VOCAB)
    plan = plan_tensor_parallel(model, mesh.size())
    for fqn in [f for f in plan.regions if f.endswith("attn")]:
        # heads left global, head_dim divided instead: shapes still fit, the function is different
        plan.attributes[fqn] = {"n_head": 4, "head_dim": 8 // mesh.size()}
    check = apply_tensor_parallel(model, mesh, plan)
    check.arm()
    model(torch.randint(0, VOCAB, (B, T)))
    try:
        check.verify()
    except TensorParallelCheckError as error:
        return {"raised": True, "message": str(error)}
    return {"raised": False, "message": ""}


def _mesh_mismatch(mesh) -> dict:
    model = M.TinyGPT(VOCAB)
    plan = plan_tensor_parallel(model, mesh.size() * 2)
    try:
        apply_tensor_parallel(model, mesh, plan)
    except ValueError as error:
        return {"raised": True, "message": str(error)}
    return {"raised": False}


def _clip_over_pipeline(world: int) -> dict:
    """Two 'pipeline stages' holding different models, each tensor-parallel over 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(7))
    expected = 0.0
    for seed in (0, 1):
        torch.manual_seed(seed)
        ref = M.TinyGPT(VOCAB)
        ref(idx).square().mean().backward()
        expected += torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item() ** 2
    torch.manual_seed(stage)
    model = M.TinyGPT(VOCAB)
    plan = plan_tensor_parallel(model, world // 2)
    apply_tensor_parallel(model, mesh["tp"], plan, self_check=False)
    model(idx).square().mean().backward()
    norm = clip_grad_norm_(model.parameters(), 1e9, group=mesh["pp"].get_group())
    return {"norm_err": abs(norm.item() - expected**0.5)}


def _case(family: str, sp: bool, tp_plan="auto"):
    return lambda mesh: _parity(family, mesh, sp, tp_plan)


def _suite(world: int) -> dict:
    if world == 2:
        cases = {f"{family}{'_sp' if sp else ''}": _case(family, sp) for family in FAMILIES for sp in (False, True)}
        cases["tinygpt_gathered_head"] = _case(
            "tinygpt", False, {"lm_head": {"style": "colwise", "output": "replicate"}}
        )
        cases["encoder_ffn_only"] = _case(
            "encoder",
            False,
            {"layers.*.self_attn": "replicate", "layers.*.linear1": "colwise", "layers.*.linear2": "rowwise"},
        )
        cases["hf_bigcode_mha"] = _case("hf_bigcode_mha", False)
        cases["torchtitan_unfused"] = _case("torchtitan_unfused", False)  # qkv_linear.wq, wk, wv
        cases["custom_heads_divide"] = _case("custom_heads", True, {"layers.*.attn": {"divide": ["heads"]}})
        cases["pipeline_stage_held"] = lambda mesh: _pipeline_stage(mesh, held={"layers.0", "layers.1"})
        cases["wrong_head_count"] = _wrong_head_count
        cases["mesh_mismatch"] = _mesh_mismatch
        return cases
    return {
        "tinygpt_sp": _case("tinygpt", True),
        "nanogpt_sp": _case("nanogpt", True),
        "meta_llama": _case("meta_llama", False),
        "torchtitan_kv_whole": _case("torchtitan", False),  # 2 key/value heads < tp=4: wqkv's k and v rows whole
        "clip_over_pipeline": lambda mesh: _clip_over_pipeline(world),
    }


def _worker(rank: int, world: int, out_dir: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, case in _suite(world).items():
        start = time.perf_counter()
        try:
            results[name] = case(mesh)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _launch(world: int) -> list[dict[str, dict]]:
    """Every rank's measurements, by rank; each rank ran every case of the suite."""
    results = spawn(_worker, world, LAUNCH_TIMEOUT_S, free_port())
    for rank, measured in enumerate(results):
        assert sorted(measured) == sorted(_suite(world)), (rank, sorted(measured))
    return results


@pytest.fixture(scope="module")
def tp2() -> list[dict[str, dict]]:
    return _launch(2)


@pytest.fixture(scope="module")
def tp4() -> list[dict[str, dict]]:
    return _launch(4)


def _records(results: list[dict], name: str) -> list[dict]:
    """``name``'s measurements on every rank: each rank compares its own view with the unsharded model, and
    every rank must pass."""
    records = [measured[name] for measured in results]
    for rank, record in enumerate(records):
        assert record.get("error") is None, f"rank {rank} {name}:\n{record['error']}"
    return records


PARITY_2 = [f"{family}{sp}" for family in FAMILIES for sp in ("", "_sp")]


def _assert_parity(record: dict) -> None:
    for key in (
        "out_err",
        "loss_err",
        "grad_err",
        "clip_norm_err",
        "clipped_grad_err",
        "step_err",
        "after_step_out_err",
        "accuracy_err",
        "reload_err",
    ):
        if key in record:
            assert record[key] < TOL, (key, record[key])
    assert record["check_err"] < 1e-4 and record["checked"], record
    assert record["loss_type"] == "Tensor"
    assert record["logits_type_outside"] == "Tensor"
    assert record["tp_ties"] == record["ties"]
    if record["loss_parallel"]:
        assert record["logits_type_in_context"] == "DTensor"  # logits stayed vocab-sharded for the loss
    if "accuracy_type" in record:
        assert record["accuracy_type"] == "Tensor"


@pytest.mark.parametrize("name", [*PARITY_2, "hf_bigcode_mha", "torchtitan_unfused"])
def test_parity_tp2(tp2, name):
    for record in _records(tp2, name):
        _assert_parity(record)


@pytest.mark.parametrize("name", ["tinygpt_sp", "nanogpt_sp", "meta_llama", "torchtitan_kv_whole"])
def test_parity_tp4(tp4, name):
    for record in _records(tp4, name):
        _assert_parity(record)


def test_gathered_head_by_user_plan(tp2):
    for record in _records(tp2, "tinygpt_gathered_head"):
        _assert_parity(record)
        assert not record["loss_parallel"] and record["logits_type_in_context"] == "Tensor"


def test_encoder_layer_feed_forward_by_user_plan(tp2):
    for record in _records(tp2, "encoder_ffn_only"):
        _assert_parity(record)
        assert record["checked"] == ["layers.0"]


def test_user_plan_divides_unknown_head_attribute(tp2):
    for record in _records(tp2, "custom_heads_divide"):
        _assert_parity(record)


@pytest.mark.parametrize("name", ["pipeline_stage_held"])
def test_plan_of_whole_model_applies_to_pipeline_stage(tp2, name):
    for record in _records(tp2, name):
        assert record["out_err"] < TOL and record["grad_err"] < TOL, record
        assert record["checked"] == ["layers.0.attn", "layers.0.mlp"]


def test_parameters_are_sharded(tp2):
    for name in ("tinygpt", "example_gpt"):
        for rank, record in enumerate(_records(tp2, name)):
            assert record["local_numel_ratio"] <= 0.55, (name, rank)


def test_self_check_catches_wrong_head_count(tp2):
    for record in _records(tp2, "wrong_head_count"):
        assert record["raised"], record
        assert "layers.0.attn" in record["message"]


def test_apply_rejects_mesh_of_other_size(tp2):
    for record in _records(tp2, "mesh_mismatch"):
        assert record["raised"] and "tp=4" in record["message"]


def test_clip_grad_norm_over_pipeline_group(tp4):
    for record in _records(tp4, "clip_over_pipeline"):
        assert record["norm_err"] < TOL


# --------------------------------------------------------------------------- plan errors (no processes)


def test_plan_restricted_to_what_a_stage_holds():
    """``held`` (the pipeline plan's modules of this rank) picks the entries at or under them; without it, all."""
    model = M.TinyGPT(VOCAB, n_layer=3)
    plan = plan_tensor_parallel(model, 2)
    planned = lambda p: {*p.styles, *p.regions, *p.attributes}  # noqa: E731
    stage = plan.restricted_to(model, held={"layers.1", "lm_head"})
    assert planned(stage) == {f for f in planned(plan) if f.startswith("layers.1.") or f == "lm_head"}
    assert "layers.1.attn" in stage.regions and "layers.0.attn" not in stage.regions
    assert planned(plan.restricted_to(model, held={""})) == planned(plan) == planned(plan.restricted_to(model))
    with pytest.raises(ValueError, match=r"held names layers\.2\.attn \(under \['layers\.2'\]\), planned as a"
                                         r" GPTAttention, but TinyGPT has no such module"):
        model.layers[2] = nn.Identity()
        plan.restricted_to(model, held={"layers.2"})
    with pytest.raises(ValueError, match=r"held='layers\.0' must be a collection of module FQNs"):
        plan.restricted_to(model, held="layers.0")


def test_plan_off_and_describe():
    model = M.NanoGPT(VOCAB)
    for off in (None, "none"):
        plan = plan_tensor_parallel(model, 2, off)
        assert not plan.enabled and apply_tensor_parallel(model, None, plan) is None
    plan = plan_tensor_parallel(
        model, 2, {"transformer.h.*.attn.c_proj": {"style": "rowwise", "output": "replicate"}}, sequence_parallel=True
    )
    text = plan.describe()
    needles = ("transformer.h.*.attn (x2) [c_attn -> c_proj] fused", "heads 4->2", "n_head=2", "n_embd=16")
    needles += ("transformer.wte: rowwise", "lm_head: colwise", "transformer.h.*.ln_1", "sequence_parallel")
    for needle in needles:
        assert needle in text, (needle, text)
    assert plan.styles["transformer.h.0.attn.c_proj"].output == "replicate"  # user entry merged over the automatic one
    gathered = plan_tensor_parallel(model, 2, loss_parallel=False)
    assert not gathered.loss_parallel and gathered.styles["lm_head"].output == "replicate"


class _FeedForwardBlocks(nn.Module):
    """Repeated blocks whose feed-forward the presets miss (a norm inside it): only a user plan shards them."""

    def __init__(self) -> None:
        super().__init__()
        ff = lambda: nn.ModuleDict(dict(fc_in=nn.Linear(8, 32), act=nn.GELU(), fc_out=nn.Linear(32, 8),  # noqa: E731
                                        norm=nn.LayerNorm(8)))
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(ff=ff())) for _ in range(3))
        self.out = nn.Linear(8, 3)


@pytest.mark.parametrize(
    ("model", "suggested", "styled"),
    [
        (Classifier, {"net.0": "colwise", "net.2": "rowwise"}, 2),  # 16->32->32: net.4 (32->4), `unused` whole
        (M.PlainMLPStack, {"net.0": "colwise", "net.2": "rowwise"}, 2),
        (_FeedForwardBlocks, {"blocks.*.ff.fc_in": "colwise", "blocks.*.ff.fc_out": "rowwise"}, 6),
    ],
)
def test_nothing_recognised_suggests_a_plan_in_the_modules_own_names(model, suggested, styled):
    with pytest.raises(ValueError, match="can be sharded automatically") as info:
        plan_tensor_parallel(model(), 2)
    message = str(info.value)
    yaml = "Fix: name the pairs to shard in tp_plan, e.g. in YAML:\n  tp_plan:" + "".join(
        f'\n    "{key}": {style}' for key, style in suggested.items()) + "\nor use tp=1."
    assert message.endswith(yaml) and "blocks.*.ff.fc_in" not in message.replace(yaml, ""), message
    plan = plan_tensor_parallel(model(), 2, suggested)  # the suggestion plans as it is
    assert len(plan.styles) == styled and {s.style for s in plan.styles.values()} == {"colwise", "rowwise"}


def test_nothing_recognised_and_no_pair_of_linears_names_the_shape_of_a_plan():
    with pytest.raises(ValueError) as info:
        plan_tensor_parallel(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(5, 4)), 2)
    assert '"<first linear>": colwise\n    "<second linear>": rowwise\nor use tp=1.' in str(info.value)


def test_user_plan_describes_which_module_got_which_style():
    text = plan_tensor_parallel(Classifier(), 2, {"net.0": "colwise", "net.2": "rowwise"}).describe()
    assert "  user      'net.0': colwise -> net.0 (Linear)" in text and "'net.2': rowwise -> net.2 (Linear)" in text
    text = plan_tensor_parallel(_FeedForwardBlocks(), 2, {"blocks.*.ff.fc_in": "colwise", "blocks.*.ff.fc_out":
                                                          {"style": "rowwise", "output": "replicate"}}).describe()
    assert ("'blocks.*.ff.fc_in': colwise -> blocks.0.ff.fc_in (Linear), blocks.1.ff.fc_in (Linear), "
            "blocks.2.ff.fc_in (Linear)") in text, text
    assert "'blocks.*.ff.fc_out': rowwise, output replicate -> blocks.0.ff.fc_out (Linear)" in text, text
    many = nn.ModuleDict(dict(net=nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])))
    text = plan_tensor_parallel(many, 2, {"net.*": "colwise"}).describe()
    assert "'net.*': colwise -> net.0 (Linear), net.1 (Linear), net.2 (Linear), ... (5 modules)" in text, text


def test_the_plan_states_its_share_and_warns_below_ninety_percent():
    from tests.lm_models import tiny_gpt
    from tests.zoo_models import zoo_lm

    plan = plan_tensor_parallel(tiny_gpt(), 2)
    assert "sharded   99% of the parameters outside the embedding and head (49,152 of 49,440)" in plan.describe()
    assert "model.layers.*.attn_norm (x4, 128)" in plan.describe()
    plan.coverage.check(2, strict=True)  # enough: neither warns nor raises
    # nn.TransformerEncoder with its attention kept whole (the fix its refusal names) shards the MLPs only.
    encoder = plan_tensor_parallel(zoo_lm("torch_transformer"), 2, {
        "encoder.layers.*.self_attn": "replicate", "encoder.layers.*.linear1": "colwise",
        "encoder.layers.*.linear2": "rowwise"})
    assert encoder.coverage.share < 0.5
    with pytest.warns(UserWarning, match="tp=2 shards only 49%.*self_attn.*tp_strict=True makes this an error"):
        encoder.coverage.check(2, strict=False)
    with pytest.raises(ValueError, match="tp=2 shards only 49%"):
        encoder.coverage.check(2, strict=True)
    # Fused projections of the zoo: GPT-NeoX and Bloom head by head, Phi-3 q|k|v and gate|up.
    for family, fused in (("gpt_neox", "[query_key_value -> dense] fused, interleaved per head"),
                          ("bloom", "[query_key_value -> dense] fused, interleaved per head"),
                          ("phi3", "[qkv_proj -> o_proj] fused, permuted per rank")):
        plan = plan_tensor_parallel(zoo_lm(family), 2)
        assert fused in plan.describe() and plan.coverage.share > 0.98, (family, plan.describe())
    assert "[gate_up_proj -> down_proj] fused, permuted per rank" in plan_tensor_parallel(zoo_lm("phi3"), 2).describe()


def test_multi_query_fused_projection_shards_q_and_keeps_k_and_v_whole():
    from lightning_4d.tensor_parallel import FusedQKVLayout
    from tests.zoo_models import zoo_lm

    plan = plan_tensor_parallel(zoo_lm("gpt_bigcode"), 2, sequence_parallel=False)
    attention = plan.regions["model.transformer.h.0.attn"]
    assert attention.kv_replicated and attention.tp_summed == ("c_attn",)
    assert plan.styles["model.transformer.h.0.attn.c_attn"].style == "colwise"
    assert plan.attributes["model.transformer.h.0.attn"] == {
        "num_heads": 2, "embed_dim": 16, "split_size": 16, "num_key_value_groups": 2,
        "kv_heads": 1}  # kv_dim stays one head, each rank's queries read it
    text = plan.describe()
    assert ("[c_attn -> c_proj] fused, q rows sharded and permuted per rank: heads 4->2, kv heads 1 < tp: the k and v"
            " rows of c_attn whole on every rank (grads summed over tp), 1 kv head used per rank") in text, text
    assert plan.coverage.share >= 0.9 and "sharded   94%" in text, text
    plan.coverage.check(2, strict=True)
    # Rows: q heads 0-3 (head_dim 2: rows 0-7), k rows 8-9, v rows 10-11; rank r's contiguous half is its two q
    # heads and the whole k and v; a checkpoint keeps the original 12 rows.
    assert attention.fused == FusedQKVLayout(q_heads=4, kv_heads=1, head_dim=8, dim=0)
    layout = FusedQKVLayout(q_heads=4, kv_heads=1, head_dim=2, dim=0)
    rows = torch.arange(12.0).unsqueeze(1)
    permuted = layout.to_tp(rows, 2, 0)
    assert permuted.squeeze(1).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11]
    assert layout.repeated(2) == [(4, 2, 1), (6, 2, 1)]
    assert torch.equal(layout.to_original(permuted, 2, 0), rows)
    # Without multi-query, GPTBigCode's c_attn holds q, k, v head by head, as GPT-NeoX's query_key_value does.
    mha = plan_tensor_parallel(_hf("hf_bigcode_mha", 2), 2).regions["transformer.h.0.attn"]
    assert mha.interleaved and mha.fused is None and not mha.kv_replicated


def test_torchtitan_fused_projection_one_level_down_is_sharded_by_key_value_group():
    """torchtitan 0.3's GQAttention holds q|k|v in ``qkv_linear.wqkv``, rows by key/value group (each group's q
    heads, then its k and v), which its FusedQKVLinear views as ``[groups, heads_per_kv + 2, head_dim]``."""
    from lightning_4d.tensor_parallel import GroupedQKVLayout
    from tests.zoo_models import zoo_lm

    lm = zoo_lm("torchtitan_llama3")
    plan = plan_tensor_parallel(lm, 2)
    text = plan.describe()
    assert ("attention model.layers.*.attention (x4) [qkv_linear.wqkv -> wo] fused, whole key/value groups per"
            " rank: heads 4->2, kv heads 2->1, head_dim 8; local n_heads=2, n_kv_heads=1") in text, text
    assert plan.coverage.share >= 0.9 and "sharded   99% of the parameters outside the embedding and head" in text
    plan.coverage.check(2, strict=True)
    assert plan.styles["model.layers.0.attention.qkv_linear.wqkv"].style == "colwise"
    assert plan.styles["model.layers.0.attention.wo"].style == "rowwise"
    layout = plan.regions["model.layers.0.attention"].fused
    assert layout == GroupedQKVLayout(q_per_kv=2, kv_heads=2, head_dim=8, dim=0) and not layout.moves(2)
    # 2 key/value heads < tp=4: each rank its q head and its group's k and v, sized for the module's view.
    four = plan_tensor_parallel(lm, 4)
    assert four.regions["model.layers.0.attention"].kv_replicated
    assert four.attributes["model.layers.0.attention.qkv_linear"] == {"heads_per_kv": 1, "r_dim": 3}
    assert ("fused, q rows sharded and permuted per rank: heads 4->1, kv heads 2 < tp: the k and v rows of"
            " qkv_linear.wqkv whole on every rank") in four.describe()
    # The rows are torchtitan's: its state-dict hook splits them into wq, wk, wv as the layout's segments.
    fused = lm.model.layers["0"].attention.qkv_linear
    with torch.no_grad():
        fused.wqkv.weight.copy_(torch.arange(64.0).unsqueeze(1).expand(64, 32))
    saved = fused.state_dict()
    segments = torch.arange(64).split(layout.widths())
    for name, part in (("wq", 0), ("wk", 1), ("wv", 2)):
        assert saved[f"{name}.weight"][:, 0].long().tolist() == torch.cat(segments[part::3]).tolist(), name
    small = GroupedQKVLayout(q_per_kv=2, kv_heads=2, head_dim=1, dim=0)  # rows q0 q1 k0 v0 | q2 q3 k1 v1
    assert small.permutation(2).tolist() == list(range(8))
    assert small.permutation(4).tolist() == [0, 2, 3, 1, 2, 3, 4, 6, 7, 5, 6, 7]
    assert small.repeated(4) == [(1, 1, 2), (2, 1, 2)]
    rows = torch.arange(8.0).unsqueeze(1)
    assert torch.equal(small.to_original(small.to_tp(rows, 4, 0), 4, 0), rows)


def test_fused_gate_up_rows_give_each_rank_its_half_of_gate_and_up():
    from lightning_4d.tensor_parallel import FusedGateUpLayout

    layout = FusedGateUpLayout(inner=4, dim=0)
    rows = torch.arange(8.0).unsqueeze(1)  # gate rows 0-3, up rows 4-7
    permuted = layout.to_tp(rows, 2, 0)
    assert permuted.squeeze(1).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # each rank's contiguous half, cut by chunk(2) as Phi-3's MLP does, is its gate and up rows
    gate, up = permuted[4:].chunk(2)
    assert gate.squeeze(1).tolist() == [2, 3] and up.squeeze(1).tolist() == [6, 7]
    assert torch.equal(layout.to_original(permuted, 2, 0), rows)
