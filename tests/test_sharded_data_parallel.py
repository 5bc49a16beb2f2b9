"""Sharded data parallelism (FSDP2 over dp_shard x cp, HSDP over dp_replicate) against one process.

Two launches: 2 processes (dp_shard=2 on the classifier and on the example GPT, ZeRO-2-like resharding, a
reduce-scatter after every accumulated batch with debug=True,
dp_shard='auto' with activation checkpointing, bf16-mixed, a checkpoint saved at dp_shard=2 and resumed at
dp_shard=2 and at dp=2) and 4 processes (dp_shard=4, HSDP 2x2, dp_shard2 x tp2 on the example GPT and on
Qwen3 with per-head norms, dp_shard2 x cp2, dp_shard2 x pp2 under 1F1B and under the zero-bubble ZBV schedule,
the dp_shard=2 checkpoint resumed at dp_shard=4 and loaded by init_from); one more resume in one process. Every
case accumulates two batches per optimizer step and clips the gradient norm, except the checkpoint cases (clipping
only) and bf16-mixed (neither).

Tolerances as in test_data_parallel.py: losses and logged values within 1e-5 relative per step, final weights
within 1e-5 + 1e-5*|w| (AdamW on the classifier, SGD with momentum on the GPT). Resumed runs are compared with
the uninterrupted single-process run after the checkpointed step (optimizer state included: a lost momentum
buffer moves the weights far outside the bound).
"""

from dataclasses import replace
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_4d import ParallelDims
from lightning_4d.data_parallel.fsdp import block_reshard, check_reshard_after_forward
from lightning_4d.context_parallel.config import ContextParallelConfig
from lightning_4d.composition.parallelize import parallelize
from lightning_4d.composition.plans import make_plans
from lightning_4d.pipeline import PipelineConfig
from lightning_4d.tensor_parallel import TensorParallelConfig
from tests.lm_models import tiny_gpt, torch_file_of
from tests.parity import Case, after_step, assert_exact_resume, assert_parity, reference, train, train_layout

CLASSIFIER = dict(module="tests.models:Classifier", data="tests.models:classification_data")
GPT = dict(module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data", batch_size=8)
ACCUMULATE_CLIP = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
GPT_ACCUMULATE_CLIP = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
VALIDATE = {"limit_val_batches": 4, "val_check_interval": 4}
TRACE = ["tests.fsdp_probes:ShardTrace"]
SAVE = 2


def _gpt(name: str, strategy: dict, **fields) -> Case:
    fields.setdefault("max_steps", 4)
    # The harness records one loss per batch and resumes by optimizer step: checkpoint cases do not accumulate.
    trainer = {"gradient_clip_val": 0.5} if "resume_at" in fields or "resume_from" in fields else GPT_ACCUMULATE_CLIP
    return Case(name, **GPT, strategy=strategy, trainer=trainer, **fields)


def _ckpt(workdir, name: str) -> str:
    return str(workdir / name / f"epoch=0-step={SAVE}.ckpt")


def _two(workdir) -> list[Case]:
    return [
        Case("shard2", **CLASSIFIER, strategy={"dp_shard": 2}, max_steps=8, callbacks=TRACE,
             trainer=dict(ACCUMULATE_CLIP, **VALIDATE)),
        _gpt("shard2_gpt", {"dp_shard": 2}, callbacks=TRACE),
        _gpt("shard2_gpt_zero2", {"dp_shard": 2, "reshard_after_forward": False}),
        # One FSDP unit per weight matrix and per module around the blocks (the example GPT's head is untied).
        _gpt("shard2_gpt_module_units", {"dp_shard": 2, "shard_units": "modules"},
             callbacks=TRACE + ["tests.fsdp_probes:UnitNames", "tests.probes:GradientLifetimeProbe"]),
        replace(_gpt("shard2_llama_module_units_checkpointed", {"dp_shard": 2, "shard_units": "modules",
                                                                 "activation_checkpointing": "full"},
                     callbacks=["tests.fsdp_probes:UnitNames"]),
                module="tests.test_tp_strategy:BodyAndHead", module_kwargs={"kind": "llama"}),
        # Reduce-scatter after every batch of the accumulation too; with the strategy's desync checks on.
        _gpt("shard2_every_batch_debug", {"dp_shard": 2, "reduce_scatter_every_batch": True, "debug": True},
             callbacks=TRACE),
        _gpt("shard_auto_gpt_checkpointed", {"dp_shard": "auto", "activation_checkpointing": "full"}),
        replace(_gpt("shard2_bf16_mixed", {"dp_shard": 2}, callbacks=TRACE), trainer={"precision": "bf16-mixed"}),
        _gpt("shard2_saved", {"dp_shard": 2}, resume_at=SAVE),
        _gpt("shard2_to_dp2", {"dp": 2}, resume_from=_ckpt(workdir, "shard2_saved")),
    ]


def _four(workdir) -> list[Case]:
    return [
        Case("shard4", **CLASSIFIER, strategy={"dp_shard": 4}, max_steps=8, trainer=ACCUMULATE_CLIP),
        _gpt("hsdp_2x2", {"dp": 2, "dp_shard": 2}, callbacks=TRACE + ["tests.fsdp_probes:CommLabels"]),
        _gpt("shard2_tp2", {"dp_shard": 2, "tp": 2}, callbacks=TRACE),
        # Qwen3's per-head q/k norms: tensor parallelism sums their gradients with a hook, so they stay out of FSDP.
        replace(_gpt("shard2_tp2_qwen3", {"dp_shard": 2, "tp": 2}, callbacks=TRACE),
                module="tests.test_tp_strategy:BodyAndHead", module_kwargs={"kind": "qwen3"}),
        _gpt("shard2_cp2", {"dp_shard": 2, "cp": 2}, callbacks=TRACE),
        _gpt("shard2_pp2", {"dp_shard": 2, "pp": 2}, callbacks=TRACE),
        # Zero-bubble, V-shaped: rank 0 holds the first and the last stage, so nanoGPT's tied wte/lm_head weight
        # is on both ends there; it stays replicated, reduced by the gradient buckets.
        replace(_gpt("shard2_pp2_zbv_nanogpt", {"dp_shard": 2, "pp": 2, "pp_schedule": "zbv_zero_bubble"},
                     callbacks=TRACE), module="tests.lm_models:NanoGPT"),
        _gpt("shard2_to_shard4", {"dp_shard": 4}, resume_from=_ckpt(workdir, "shard2_saved")),
        _gpt("shard4_init_from", {"dp_shard": 4, "init_from": _ckpt(workdir, "shard2_saved")}, max_steps=2),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sharded")
    records = dict(train_layout(_two(workdir), 2, timeout=600, workdir=str(workdir)))
    records.update(train_layout(_four(workdir), 4, timeout=600, workdir=str(workdir)))
    records["shard2_to_one"] = train(_gpt("shard2_to_one", {}, resume_from=_ckpt(workdir, "shard2_saved")),
                                     distributed=True)
    # One plain process (Lightning's own strategy) that loads the checkpoint's weights as torch converts the
    # directory and as a user loads a file: nothing of lightning-4d on this side.
    torch_file = torch_file_of(_ckpt(workdir, "shard2_saved"), str(workdir / "shard2_saved_by_torch.pt"))
    plain = replace(_gpt("one_init_from", {}, max_steps=2), module="tests.lm_models:loaded_module",
                    module_kwargs={"build": GPT["module"], "path": torch_file})
    records["one_init_from"] = train(plain, distributed=False)
    return {case.name: case for case in _two(workdir) + _four(workdir)}, records


@pytest.mark.parametrize("name", ["shard2", "shard4"])
def test_sharded_classifier_matches_single_process(runs, name):
    cases, records = runs
    case = cases[name]
    epoch_metrics = ("train_acc", "val_loss", "val_acc") if case.trainer.get("limit_val_batches") else ("train_acc",)
    assert_parity(case, reference(case), records[name], epoch_metrics=epoch_metrics)


@pytest.mark.parametrize("name", ["shard2_gpt", "shard2_gpt_zero2", "shard2_every_batch_debug",
                                  "shard_auto_gpt_checkpointed", "hsdp_2x2",
                                  "shard2_tp2", "shard2_tp2_qwen3", "shard2_cp2", "shard2_pp2",
                                  "shard2_pp2_zbv_nanogpt"])
def test_sharded_gpt_matches_single_process(runs, name):
    cases, records = runs
    assert_parity(cases[name], reference(cases[name]), records[name])


def test_a_sharded_checkpoint_resumes_exactly_and_in_other_layouts(runs):
    cases, records = runs
    assert_exact_resume(records["shard2_saved"])
    assert_parity(cases["shard2_saved"], reference(cases["shard2_saved"]), records["shard2_saved"])
    expected = after_step(reference(cases["shard2_saved"]), SAVE)
    for name in ("shard2_to_dp2", "shard2_to_shard4", "shard2_to_one"):
        assert_parity(replace(cases["shard2_saved"], name=name), expected, records[name])


def test_bf16_mixed_gathers_in_bf16_and_reduces_in_fp32(runs):
    """precision='bf16-mixed' becomes FSDP's MixedPrecisionPolicy; against one process at bf16-mixed with the
    tolerances of test_mixed_precision.py (losses within 2e-2 relative, every weight's update within 10% of the
    single-process update in norm)."""
    cases, records = runs
    case, got = cases["shard2_bf16_mixed"], records["shard2_bf16_mixed"]
    assert got["extras"]["dtypes"] == ["all_gather torch.bfloat16", "reduce_scatter torch.float32"]
    assert records["shard2_gpt"]["extras"]["dtypes"] == ["all_gather torch.float32", "reduce_scatter torch.float32"]
    expected = reference(case)
    assert len(got["losses"]) == len(expected["losses"]) == case.max_steps
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"])):
        assert abs(a - b) <= 2e-2 * abs(b), f"loss at step {step}: {a} vs {b}"
    pl.seed_everything(case.seed, verbose=False)
    for name, start in tiny_gpt().state_dict().items():
        assert got["weights"][name].dtype == torch.float32, name  # fp32 master weights
        update, reference_update = got["weights"][name] - start, expected["weights"][name] - start
        error = (update - reference_update).norm() / reference_update.norm().clamp_min(1e-12)
        assert error <= 0.1, f"update of {name} off by {error:.3f} of its norm"


def test_init_from_a_sharded_checkpoint(runs):
    """Weights only (fresh optimizer) from the dp_shard=2 checkpoint: dp_shard=4 trains as one process does."""
    cases, records = runs
    assert_parity(cases["shard4_init_from"], records["one_init_from"], records["shard4_init_from"])
    # Both start from the checkpoint's weights, not the module's own: the first batch's loss is not a fresh run's.
    fresh = reference(cases["shard2_saved"])["losses"][0]
    assert abs(records["one_init_from"]["losses"][0] - fresh) > 1e-3, (records["one_init_from"]["losses"], fresh)


def test_parameters_are_sharded_over_dp_shard_and_cp(runs):
    _, records = runs
    expected_mesh = {"shard2_gpt": ["dp_shard_cp"], "hsdp_2x2": ["dp_replicate", "dp_shard_cp"],
                     "shard2_cp2": ["dp_shard_cp"], "shard2_tp2": ["dp_shard_cp", "tp"], "shard2": ["dp_shard_cp"],
                     "shard2_tp2_qwen3": ["dp_shard_cp", "tp"]}
    expected_mesh.update({"shard2_pp2": ["dp_shard_cp"], "shard2_pp2_zbv_nanogpt": ["dp_shard_cp"]})
    # What rank 0 holds: the first of 2 stages (1f1b), the first and the last of 4 (zbv).
    held = {"shard2_pp2": ("model.tok_emb.", "model.layers.0.", "model.layers.1."),
            "shard2_pp2_zbv_nanogpt": ("transformer.wte.", "transformer.wpe.", "transformer.ln_f.",
                                       "transformer.h.0.", "transformer.h.3.")}
    for name, mesh in expected_mesh.items():
        extras = records[name]["extras"]
        layout = extras["layout"]
        # Only per-head norms, whose gradients tensor parallelism sums with a hook, and a weight tied across the
        # first and the last pipeline stage stay out of FSDP; the gradient buckets reduce those and nothing else
        # (they would all-reduce again what FSDP reduced).
        kept = sorted(param for param, entry in layout.items() if "dp_shard_cp" not in entry["mesh"])
        assert extras["buckets"] == kept, (name, extras["buckets"], kept)
        head_norms = [param for param in layout if ".q_norm." in param or ".k_norm." in param]
        tied = ["transformer.wte.weight"] if name == "shard2_pp2_zbv_nanogpt" else []
        assert kept == sorted(head_norms + tied) and bool(head_norms) == (name == "shard2_tp2_qwen3"), (name, kept)
        # Rank 0 says which parameters it keeps replicated (the strategy prints this at start-up).
        said = [line for line in extras["described"].splitlines() if "kept replicated" in line]
        prefix = "dp_shard=2: kept replicated on rank 0, all-reduced over dp x cp: "
        assert len(said) == bool(kept) and all(line.startswith(prefix) for line in said), (name, said)
        assert sorted(param for line in said for param in line[len(prefix):].split(", ")) == kept, (name, said)
        if name in held:
            assert all(param.startswith(held[name]) for param in layout), (name, list(layout))
            assert all(any(param.startswith(prefix) for param in layout) for prefix in held[name]), (name, list(layout))
        for param, entry in layout.items():
            if param in kept:
                continue
            # Under tp, what tensor parallelism leaves whole (norms) is sharded over dp_shard_cp only.
            allowed = (mesh, ["dp_shard_cp"]) if "tp" in mesh else (mesh,)
            assert entry["dtensor"] and entry["mesh"] in allowed, (name, param, entry)
            on_dp = entry["placements"][entry["mesh"].index("dp_shard_cp")]
            assert on_dp == "Shard(dim=0)" or on_dp.startswith("_StridedShard(dim=0"), (name, param, entry)
            # Each rank holds its share: half over dp_shard_cp (uneven dim 0 pads at most one row of <= 64
            # elements per rank), half again over tp; HSDP replicas hold the same half.
            share = 2 * (2 if "tp" in entry["mesh"] else 1)
            assert entry["local"] * share <= entry["full"] + share * 64, (name, param, entry)


def test_accumulation_reduce_scatters_only_before_optimizer_steps(runs):
    """With two batches per optimizer step, FSDP reduce-scatters during the second batch's backward only."""
    for name in ("shard2", "shard2_gpt", "hsdp_2x2", "shard2_pp2", "shard2_pp2_zbv_nanogpt"):
        batches = runs[1][name]["extras"]["reduce_scatters"]
        assert batches, f"{name}: no reduce-scatter at all"
        assert all(batch % 2 == 1 for batch in batches), (name, batches)
        assert set(batches) >= {1, 3}, (name, batches)
    # reduce_scatter_every_batch=True: every batch of the accumulation reduce-scatters, the first ones too (batch
    # indices count within an epoch of 4 batches), as often in each as the last one.
    every = runs[1]["shard2_every_batch_debug"]["extras"]["reduce_scatters"]
    assert set(every) == {0, 1, 2, 3} and every.count(0) == every.count(1), every


def test_telemetry_names_the_sharding_and_the_replica_traffic(runs):
    """Under HSDP, FSDP's all-gathers and reduce-scatters count as dp_shard, the replicas' all-reduce as
    dp_replicate; nothing is left unattributed."""
    labels = runs[1]["hsdp_2x2"]["extras"]["comm_labels"]
    assert {"dp_shard", "dp_replicate"} <= set(labels) and "other" not in labels, labels


def test_sizes_and_bad_input():
    assert ParallelDims.resolve(4, dp_shard=2) == ParallelDims(dp=4, pp=1, cp=1, tp=1, dp_shard=2)  # HSDP 2x2
    assert ParallelDims.resolve(4, dp=1, dp_shard=2, tp=2).dp_replicate == 1
    dims = ParallelDims.resolve(8, dp_shard="auto", tp=2)
    assert (dims.dp, dims.dp_shard, dims.dp_replicate) == (4, 4, 1)
    assert ParallelDims.resolve(8, dp=2, dp_shard="auto").dp_shard == 4
    assert ParallelDims.resolve(2, dp=2) == ParallelDims(dp=2, pp=1, cp=1, tp=1)  # dp keeps meaning replicas
    assert "dp=4 (dp_replicate=2 x dp_shard=2)" in ParallelDims.resolve(4, dp=2, dp_shard=2).layout_table()
    with pytest.raises(ValueError, match=r"dp_shard=0 is not a valid size: use a positive integer or 'auto'"):
        ParallelDims.resolve(4, dp_shard=0)
    with pytest.raises(ValueError, match=r"dp\*dp_shard\*pp\*cp\*tp = 1\*2\*1\*1\*1 = 2 does not equal the world"):
        ParallelDims.resolve(4, dp=1, dp_shard=2)
    with pytest.raises(ValueError, match=r"dp_shard='auto' needs the world size \(6\) to be a multiple of"):
        ParallelDims.resolve(6, dp=4, dp_shard="auto")
    with pytest.raises(ValueError, match=r"dp='auto' needs the world size \(6\) to be a multiple of pp\*cp\*tp\*dp"):
        ParallelDims.resolve(6, dp_shard=4)
    with pytest.raises(ValueError, match="must be a multiple of dp_shard"):
        ParallelDims(dp=3, pp=1, cp=1, tp=1, dp_shard=2)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=f"reshard_after_forward={bad!r} is not valid"):
            check_reshard_after_forward(bad)
    assert [block_reshard(i, 3, "auto") for i in range(3)] == [True, True, False]
    assert [block_reshard(i, 2, False) for i in range(2)] == [False, False]


def test_sharding_takes_manual_optimization_and_refuses_resharding_every_micro_batch_before_any_collective():
    module = tiny_gpt()
    module.automatic_optimization = False  # synchronized by each manual_backward (tests/test_manual_optimization.py)
    make_plans(module, ParallelDims.resolve(2, dp_shard=2), pipeline=PipelineConfig(1), tensor=TensorParallelConfig(1))
    module.automatic_optimization = True
    # No process group exists here: the refusal comes before parallelize's first collective.
    with pytest.raises(ValueError, match=r"reshard_after_forward=True with dp_shard=2 and pp=2: under pipelining"):
        parallelize(module, SimpleNamespace(dims=ParallelDims.resolve(4, dp_shard=2, pp=2)), torch.device("cpu"),
                    pipeline=PipelineConfig(2), tensor=TensorParallelConfig(1), context=ContextParallelConfig(),
                    reshard_after_forward=True)


def test_strategy_takes_dp_shard_from_yaml():
    from jsonargparse import ArgumentParser

    from lightning_4d import FourDStrategy

    parser = ArgumentParser()
    parser.add_class_arguments(FourDStrategy, "strategy")
    config = parser.parse_args(["--strategy.dp_shard=auto", "--strategy.reshard_after_forward=false"])
    strategy = parser.instantiate_classes(config).strategy
    assert strategy.requested_sizes["dp_shard"] == "auto" and strategy.composition["reshard_after_forward"] is False
    with pytest.raises(ValueError, match="reshard_after_forward='always' is not valid"):
        FourDStrategy(reshard_after_forward="always")
    with pytest.raises(ValueError, match=r"dp_shard=-1 is not a valid size"):
        FourDStrategy(dp_shard=-1)


def test_module_units_shard_each_weight_matrix_on_its_own(runs):
    """shard_units='modules': every linear of a block and the modules around the blocks are FSDP units (the
    root and each block keep the norms); parity is in the tests above. The default has one unit per block."""
    _, records = runs
    gpt = records["shard2_gpt_module_units"]["extras"]["units"]
    blocks = sorted({name.rsplit(".", 2)[0] for name in gpt if ".layers." in name and name.count(".") > 2})
    assert len(blocks) >= 2 and "" in gpt, gpt
    weight_units = [name for name in gpt if name.count(".") > 2]
    assert len(weight_units) >= 4 * len(blocks), gpt  # q/k/v/o or qkv/proj and the MLP's linears in every block
    assert any("head" in name for name in gpt) and any("emb" in name for name in gpt), gpt
    llama = records["shard2_llama_module_units_checkpointed"]["extras"]["units"]
    for block in ("model.layers.0", "model.layers.1"):
        for linear in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert any(name.endswith(f"{block}.{linear}") for name in llama), (block, linear, llama)
    assert any(name.endswith("lm_head") for name in llama) and any(name.endswith("embed_tokens") for name in llama)
    assert len(records["shard2_gpt"]["extras"]["layout"]) > 0


def test_module_units_do_not_gather_the_embedding_again_for_backward(runs):
    """An embedding's backward reads only its indices, so its unit is not gathered in backward; the head, fused
    with its loss (lightning_4d.numerics.head_loss), stays gathered from its forward to its backward: of the two
    vocabulary x width tables the GPT gathers in forward (embedding and head), backward gathers neither."""
    _, records = runs
    extras = records["shard2_gpt_module_units"]["extras"]
    table = extras["layout"]["model.tok_emb.weight"]["full"]
    assert extras["layout"]["model.lm_head.weight"]["full"] == table
    backwards = extras["backward_gathers"]
    assert len(backwards) == 4 * 2, backwards  # 4 optimizer steps of 2 accumulated batches
    assert all(sizes.count(table) == 0 for sizes in backwards), (table, backwards)


def test_the_previous_windows_gradients_are_freed_before_the_next_forward(runs):
    """4 optimizer steps of 2 accumulated batches: when Lightning zeroes the gradients after each later window's
    first training_step, none of the previous window's sharded gradients is alive on either rank."""
    _, records = runs
    assert records["shard2_gpt_module_units"]["extras"]["alive_at_zero_grad"] == [[0, 0, 0], [0, 0, 0]]


def test_module_units_are_refused_where_they_save_nothing_or_break_compile():
    from lightning_4d import FourDStrategy

    with pytest.raises(ValueError, match="shard_units='modules' with pp=2"):
        FourDStrategy(dp_shard=2, pp=2, shard_units="modules")
    with pytest.raises(ValueError, match="shard_units='modules' with tp=2"):
        FourDStrategy(dp_shard=2, tp=2, shard_units="modules")
    with pytest.raises(ValueError, match="shard_units='modules' with compile=True"):
        FourDStrategy(dp_shard=2, shard_units="modules", compile=True)
    with pytest.raises(ValueError, match="shard_units='layers' is not valid"):
        FourDStrategy(dp_shard=2, shard_units="layers")
