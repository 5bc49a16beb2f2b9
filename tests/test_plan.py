"""The layout planner: its arithmetic against Megatron's formulas, its refusals, and its memory estimate
against the peak measured in CPU runs of the example GPT under several layouts.

Measuring on CPU: the peak is the process's resident-set high-water mark (``VmHWM``), restarted right before
the model is built, minus the resident set at that moment, so the runtime's own ~300 MB is not counted.
glibc's malloc raises its mmap threshold after large frees and then keeps freed memory in its heap; the
measured ranks fix the threshold (``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_`` does at start-up,
called before the model is built in each rank, forked from the harness's server like any launch's) so that freed
tensors go back to the system and the resident set follows live tensors, as ``max_memory_allocated`` does on a GPU.
"""

import ctypes
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_4d.demos.gpt import GPT
from lightning_4d.planner import (
    AC_MODES,
    Layout,
    Model,
    PlanError,
    Training,
    activation_bytes_per_layer,
    all_layouts,
    choose_cp_comm,
    cp_exchanges,
    estimate,
    layout_problems,
    plan,
)
from lightning_4d.planner.cli import main
from lightning_4d.observability.telemetry import PeakMemory
from tests.lm_models import token_data
from tests.parity import Case, train_layout

# ----------------------------------------------------------------------------------- arithmetic


def test_counts_read_from_a_module_match_its_parameters_and_the_sizes():
    config = dict(vocab_size=256, n_layer=3, n_head=4, n_embd=64, block_size=32)
    module = GPT(**config)
    model = Model.from_module(module)
    assert (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.vocab) == (
        3, 64, 4, 4, 256, 256)
    assert model.params == sum(p.numel() for p in module.parameters())
    assert model == Model.from_sizes(layers=3, hidden=64, heads=4, vocab=256)
    tied = Model.from_module(GPT(**config, tie_weights=True))
    assert tied.tied and tied.params == sum(p.numel() for p in GPT(**config, tie_weights=True).parameters())
    assert tied == Model.from_sizes(layers=3, hidden=64, heads=4, vocab=256, tied=True)
    # A Hugging Face Llama: grouped-query attention and a gated MLP, head counts from its config.
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(config)
    model = Model.from_module(llama)
    assert model.params == sum(p.numel() for p in llama.parameters())
    assert model == Model.from_sizes(layers=3, hidden=64, heads=8, kv_heads=2, ffn_hidden=176, vocab=128,
                                     gated_mlp=True)


def test_activations_are_megatrons_formula_in_its_setting():
    """16-bit activations, dropout, materialized attention scores and one-kernel norms: Korthikanti et al.
    give s*b*h*(34 + 5*a*s/h) bytes per layer; with tp, 10 + 24/t + 5*a*s/(h*t); with sequence parallelism
    everything divided by t, except the gathered region inputs ours keep whole."""
    s, b, h, a = 256, 2, 128, 8
    model = Model.from_sizes(layers=4, hidden=h, heads=a, vocab=512)
    megatron = Training(seq_len=s, global_batch=b, precision="16-true", fused_attention=False, fused_norm=True,
                        dropout=True)
    per_layer = activation_bytes_per_layer
    assert per_layer(model, megatron, Layout()) == s * b * h * (34 + 5 * a * s / h)
    for t in (2, 4):
        assert per_layer(model, megatron, Layout(tp=t)) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        sp = Training(**{**megatron.__dict__, "sequence_parallel": True})
        gathered_inputs = 2 * 2  # the q/k/v and MLP inputs, 2 bytes each
        assert per_layer(model, sp, Layout(tp=t)) == pytest.approx(
            s * b * h * ((34 - gathered_inputs) / t + gathered_inputs + 5 * a * s / (h * t)))
    # Context parallelism splits the sequence: per layer, the fused-attention bytes halve at cp=2.
    fused = Training(seq_len=s, global_batch=b)
    assert per_layer(model, fused, Layout(cp=2)) == per_layer(model, fused, Layout()) / 2


def test_model_state_and_communication_by_dim():
    model = Model.from_sizes(layers=8, hidden=256, heads=8, vocab=1024)
    training = Training(seq_len=64, global_batch=8, precision="bf16-mixed")
    params = model.params
    single = estimate(model, training, Layout())
    assert single.memory["params"] == 4 * params and single.memory["grads"] == 4 * params
    assert single.memory["optimizer"] == 8 * params and single.comm["total"] == 0
    dp = estimate(model, training, Layout(dp=4))
    assert dp.comm["dp"] == 2 * 3 / 4 * 4 * params and dp.memory["grad_buckets"] == 4 * params
    assert dp.memory["activations"] == pytest.approx(single.memory["activations"] / 4, rel=0.01)
    true16 = estimate(model, Training(seq_len=64, global_batch=8, precision="bf16-true"), Layout())
    assert true16.memory["params"] + true16.memory["grads"] + true16.memory["optimizer"] == 8 * params
    tp = estimate(model, training, Layout(tp=2))
    tokens, layers = 64 * 8, 8
    all_reduce = 2 * 1 / 2 * tokens * 256 * 2  # ring all-reduce of one bf16 activation at tp=2
    assert tp.comm["tp"] == 4 * all_reduce * layers + all_reduce
    assert tp.memory["params"] < single.memory["params"] / 2 + 256 * layers * 2 * 4 + 1
    pp = estimate(model, training, Layout(pp=2))  # 1F1B, 4 micro-batches of 2 samples
    assert pp.comm["pp"] == 4 * 64 * 2 * 256 * 2 and pp.memory["pipeline_grads"] == pp.memory["grads"]
    cp = estimate(model, training, Layout(cp=2))
    q_block = 32 * 8 * 256 * 2  # this rank's 32 tokens of 8 samples, all heads, bf16
    assert cp.comm["cp"] == 2 * 1 / 2 * (2 * q_block + 2 * q_block) * layers  # Ulysses: 8 heads, cp=2 divides them


def test_the_planner_chooses_the_context_parallel_exchange():
    """Ring: 3 (cp-1) K/V blocks per layer; Ulysses (a2a): (cp-1)/cp of q, k, v, out and their gradients.
    Multi-head attention at cp=2 sends less by a2a; 32 query heads over 8 key/value heads at cp=2 less by the ring
    (its K/V blocks are a quarter of q); a2a is not offered where cp does not divide the heads per tp rank."""
    training = Training(seq_len=4096, global_batch=8)
    mha = Model.from_sizes(layers=4, hidden=1024, heads=16, vocab=1024)
    gqa = Model.from_sizes(layers=4, hidden=1024, heads=32, kv_heads=8, vocab=1024)
    exchanges = cp_exchanges(mha, training, Layout(cp=2))
    assert exchanges["a2a"] == pytest.approx(exchanges["ring"] * 4 / 6)
    assert choose_cp_comm(mha, training, Layout(cp=2)) == "a2a"
    assert choose_cp_comm(gqa, training, Layout(cp=2)) == "ring"
    assert choose_cp_comm(gqa, training, Layout(cp=8)) == "a2a"  # the ring's 3 (cp-1) blocks grow with cp
    assert "a2a" not in cp_exchanges(gqa, training, Layout(cp=4, tp=4))  # 2 kv heads per tp rank


def test_layouts_are_every_factorization_and_problems_name_the_constraint():
    assert len(all_layouts(8, shard=False)) == 20 and all(layout.devices == 8 for layout in all_layouts(8))
    # With sharding, each data-parallel size d is also split into replicas x shards in every way (1, 2 or 4 ways).
    unsharded = {(lay.dp, lay.pp, lay.cp, lay.tp) for lay in all_layouts(8, shard=False)}
    assert {(lay.data_parallel, lay.pp, lay.cp, lay.tp) for lay in all_layouts(8)} == unsharded
    assert len(all_layouts(8)) == sum({1: 1, 2: 2, 4: 3, 8: 4}[dp] for dp, *_ in unsharded) == 35
    model = Model.from_sizes(layers=4, hidden=96, heads=6, vocab=301)
    training = Training(seq_len=90, global_batch=6)
    assert layout_problems(model, training, Layout(dp=2, tp=3)) == ["tp=3 does not divide vocab (301)"]
    assert layout_problems(model, training, Layout(tp=4)) == ["tp=4 does not divide heads (6)",
                                                              "tp=4 does not divide kv_heads (6)",
                                                              "tp=4 does not divide vocab (301)"]
    assert layout_problems(model, training, Layout(cp=2)) == [
        "cp=2 needs the sequence (90) divisible by 2*cp=4"]
    assert layout_problems(model, training, Layout(dp=4)) == ["dp=4 does not divide the global batch (6)"]
    assert layout_problems(model, training, Layout(pp=8)) == [
        "pp=8 exceeds the 4 layers", "the batch per replica (6) does not divide into 16 pipeline micro-batches"]
    assert layout_problems(model, training, Layout(dp=3, pp=2)) == [
        "the batch per replica (2) does not divide into 4 pipeline micro-batches"]


def test_sharded_data_parallelism_divides_the_model_state_and_is_recommended_when_replicas_do_not_fit():
    model = Model.from_sizes(layers=8, hidden=256, heads=8, vocab=1024)
    training = Training(seq_len=64, global_batch=8)
    params = model.params
    state = lambda est: est.memory["params"] + est.memory["grads"] + est.memory["optimizer"]  # noqa: E731
    assert state(estimate(model, training, Layout())) == 16 * params  # fp32 AdamW
    for layout, shards in ((Layout(dp_shard=2), 2), (Layout(dp_shard=4), 4), (Layout(dp=2, dp_shard=2), 2),
                           (Layout(dp_shard=2, cp=2), 4)):  # cp ranks share the shards
        est = estimate(model, training, layout)
        assert state(est) == 16 * params / shards and est.memory["grad_buckets"] == 0, layout
        assert est.memory["gathered"] > 0 and est.comm["dp_shard"] > 0, layout
    # Under pp one all-gather and one reduce-scatter per step over the 2 shards: the volume of DDP's all-reduce.
    sharded_pp, replicated_pp = (estimate(model, training, Layout(dp=dp, dp_shard=shard, pp=2))
                                 for dp, shard in ((1, 2), (2, 1)))
    assert sharded_pp.comm["dp_shard"] == pytest.approx(replicated_pp.comm["dp"]) and sharded_pp.comm["dp"] == 0
    # HSDP: the replicas all-reduce a shard of the gradients.
    hsdp = estimate(model, training, Layout(dp=2, dp_shard=2))
    assert hsdp.comm["dp"] == pytest.approx(2 * 1 / 2 * 4 * params / 2, rel=0.01)
    assert layout_problems(model, Training(seq_len=64, global_batch=6), Layout(dp=1, dp_shard=4)) == [
        "dp*dp_shard=4 does not divide the global batch (6)"]
    # 4 devices (2 layers, 3 heads, a sequence of 63: no tp, no cp, pp <= 2) and memory that no replicated layout
    # fits: the planner recommends sharding. Sharding under pp sends what DDP sends, so it ranks first anyway.
    model, training = Model.from_sizes(layers=2, hidden=96, heads=3, vocab=8192), Training(seq_len=63, global_batch=8)
    ranked = plan(model, training, devices=4)
    assert str(ranked[0].layout) == "dp=1 dp_shard=2 pp=2 cp=1 tp=1", [str(est.layout) for est in ranked]
    replicated = min(est.memory["total"] for est in ranked if est.layout.dp_shard == 1)
    sharded = min(est.memory["total"] for est in ranked if est.layout.dp_shard > 1)
    assert sharded < replicated
    fitting = plan(model, training, devices=4, memory_per_device=(sharded + replicated) / 2)
    assert fitting and all(est.layout.dp_shard > 1 for est in fitting), [str(est.layout) for est in fitting]


def test_plan_ranks_fitting_layouts_by_communication():
    model = Model.from_sizes(layers=8, hidden=512, heads=8, vocab=256)
    training = Training(seq_len=128, global_batch=8)
    ranked = plan(model, training, devices=4, memory_per_device=300 * 2**20)
    assert ranked and all(est.fits for est in ranked)
    assert all(est.memory["total"] <= 300 * 2**20 for est in ranked)
    comm = [est.comm["total"] for est in ranked]
    assert comm == sorted(comm)
    everything = plan(model, training, devices=4, memory_per_device=300 * 2**20, include_unfit=True)
    assert len(everything) > len(ranked) and everything[:len(ranked)] == ranked
    assert not any(est.fits for est in everything[len(ranked):])



def test_setup_peak_of_a_whole_and_a_meta_build():
    """Whole-built: every rank holds the whole model and at most one broadcast bucket. Meta-built (or init_from):
    the rank's share and the largest tensor, the one being filled."""
    from lightning_4d.composition.weight_agreement import BROADCAST_BUCKET_BYTES as runtime_bucket
    from lightning_4d.planner.estimate import BROADCAST_BUCKET_BYTES

    assert BROADCAST_BUCKET_BYTES == runtime_bucket
    model = Model.from_sizes(layers=8, hidden=256, heads=8, vocab=1024)
    training = Training(seq_len=64, global_batch=8)
    model_bytes, largest = 4 * model.params, 4 * model.largest_tensor
    assert model.largest_tensor == 1024 * 256  # the embedding (and the MLP's 256 x 1024)
    for est in plan(model, training, devices=8):  # every valid layout
        assert model_bytes <= est.setup["whole"] <= model_bytes + BROADCAST_BUCKET_BYTES, est.layout
        assert est.setup["meta"] == est.memory["params"] + largest or est.layout.pp > 1, est.layout
        assert est.setup["meta"] < est.setup["whole"], est.layout
    single = estimate(model, training, Layout())
    assert single.setup == {"whole": 2 * model_bytes, "meta": model_bytes + largest}  # the model is < one bucket
    tp = estimate(model, training, Layout(tp=2))  # norm gains stay whole: about half
    assert tp.setup["meta"] == pytest.approx(model_bytes / 2 + largest, rel=0.01)
    shard = estimate(model, training, Layout(dp_shard=4))
    assert shard.setup["meta"] == pytest.approx(model_bytes / 4 + largest)
    pp = estimate(model, training, Layout(pp=2))  # the heavier stage's share
    assert model_bytes / 2 < pp.setup["meta"] - largest < 0.6 * model_bytes
    assert estimate(model, Training(seq_len=64, global_batch=8, precision="bf16-true"), Layout(tp=2)).setup == {
        name: value / 2 for name, value in tp.setup.items()}  # built in the parameters' dtype
    # The largest tensor read from modules is the largest parameter.
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2)
    for module in (GPT(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=32),
                   GPT(vocab_size=64, n_layer=2, n_head=4, n_embd=64, block_size=32),
                   transformers.LlamaForCausalLM(config)):
        assert Model.from_module(module).largest_tensor == max(p.numel() for p in module.parameters())
    # Against bench/meta_init_memory.py's measurement (docs/checkpoints.md: a Llama of 151M parameters, growth per
    # rank during setup): whole-built 0.62 GB in one process, 0.69 GB at tp=2 and dp_shard=2; meta-built 0.32 GB.
    llama = Model.from_sizes(layers=8, hidden=1024, heads=8, ffn_hidden=4096, gated_mlp=True, vocab=8192)
    sgd = Training(seq_len=64, global_batch=2, optimizer="sgd")
    for layout, build, measured in ((Layout(), "whole", 0.62e9), (Layout(tp=2), "whole", 0.69e9),
                                    (Layout(dp_shard=2), "whole", 0.69e9), (Layout(tp=2), "meta", 0.32e9),
                                    (Layout(dp_shard=2), "meta", 0.32e9)):
        assert estimate(llama, sgd, layout).setup[build] == pytest.approx(measured, rel=0.1), (layout, build)


def test_a_layout_whose_whole_build_does_not_fit_is_marked_and_meta_is_named_as_the_fix(capsys):
    model = Model.from_sizes(layers=8, hidden=512, heads=8, vocab=8192)
    training = Training(seq_len=64, global_batch=8, activation_checkpointing="full")
    layouts = plan(model, training, devices=8)
    limit = (max(est.setup["meta"] for est in layouts) + min(est.setup["whole"] for est in layouts)) / 2
    fits_training = [est for est in layouts if est.memory["total"] <= limit]
    assert fits_training and all(est.setup["whole"] > limit for est in layouts)
    with pytest.raises(PlanError) as error:
        plan(model, training, devices=8, memory_per_device=limit)
    assert f"{len(fits_training)} fit training, but building the model needs at least" in str(error.value)
    assert "plan with --build meta" in str(error.value)
    marked = plan(model, training, devices=8, memory_per_device=limit, include_unfit=True)
    assert {est.layout for est in marked if est.exceeds == ("setup",)} == {est.layout for est in fits_training}
    meta = plan(model, training, devices=8, memory_per_device=limit, build="meta")
    assert {est.layout for est in meta} == {est.layout for est in fits_training} and all(est.fits for est in meta)
    # The table: a setup column and "no: setup" where only building does not fit.
    sizes = ["--devices", "8", "--layers", "8", "--hidden", "512", "--heads", "8", "--vocab", "8192", "--seq", "64",
             "--global-batch", "8", "--activation-checkpointing", "full", "--memory", f"{limit:.0f}B"]
    assert main([*sizes, "--all"]) == 0
    table = capsys.readouterr().out
    assert "  setup  " in table and "no: setup" in table and "built (whole)" in table
    assert main([*sizes, "--build", "meta", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["build"] == "meta" and all(set(e["setup_bytes"]) == {"whole", "meta"} for e in report["layouts"])
    with pytest.raises(PlanError, match=r"build='half' is not one of whole, meta: 'whole' when every rank"):
        plan(model, training, devices=8, build="half")
    with pytest.raises(SystemExit) as exit_:
        main([*sizes, "--build", "half"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m lightning_4d.plan: error: argument --build: invalid choice: 'half'"), err
    assert "whole" in err and "meta" in err


# ------------------------------------------------------------------------------------ refusals


def test_impossible_device_count_names_the_inputs_and_nearby_counts():
    model = Model.from_sizes(layers=8, hidden=512, heads=4, vocab=256)
    with pytest.raises(PlanError) as error:
        plan(model, Training(seq_len=100, global_batch=4), devices=7)
    message = str(error.value)
    assert "no layout of 7 devices" in message
    assert "tp=7 does not divide heads (4)" in message and "dp=7 does not divide the global batch (4)" in message
    assert "cp=7 needs the sequence (100) divisible by 2*cp=14" in message
    assert "nearest that work: 4, 5, 8" in message


def test_too_little_memory_names_the_smallest_estimate_and_what_to_change():
    model = Model.from_sizes(layers=32, hidden=4096, heads=32, vocab=32000)
    with pytest.raises(PlanError) as error:
        plan(model, Training(seq_len=4096, global_batch=8), devices=8, memory_per_device=16 * 2**30)
    message = str(error.value)
    assert message.startswith("no layout fits in 16.00 GiB per device: the smallest estimate is")
    assert "more devices" in message and "bf16-true" in message and "shorter sequence" in message


def test_bad_sizes_are_refused_with_the_fix():
    with pytest.raises(PlanError, match=r"hidden=100 is not divisible by heads=3.*divisors of 100"):
        Model.from_sizes(layers=2, hidden=100, heads=3, vocab=10)
    with pytest.raises(PlanError, match=r"heads=8 is not a multiple of kv_heads=3"):
        Model.from_sizes(layers=2, hidden=64, heads=8, kv_heads=3, vocab=10)
    with pytest.raises(PlanError, match=r"params=1,000 is less than the .* that 2 layers of hidden size 64"):
        Model.from_sizes(layers=2, hidden=64, heads=8, params=1000)
    with pytest.raises(PlanError, match=r"params=1,000,000,000 disagrees with the sizes"):
        Model.from_sizes(layers=2, hidden=64, heads=8, vocab=10, params=10**9)
    with pytest.raises(PlanError, match=r"global_batch=0 must be a positive integer"):
        Training(seq_len=8, global_batch=0)
    with pytest.raises(PlanError, match=r"activation_checkpointing='some' is not one of none, full, every_n"):
        Training(seq_len=8, global_batch=1, activation_checkpointing="some")


def test_activation_checkpointing_modes_are_the_strategys_and_lower_the_estimate(capsys):
    from lightning_4d.memory.activation_checkpointing import MODES

    assert AC_MODES == MODES
    sizes = ["--devices", "1", "--layers", "8", "--hidden", "512", "--heads", "8", "--vocab", "256", "--seq", "512",
             "--global-batch", "4", "--json"]
    memory = {}
    for mode in MODES:
        assert main([*sizes, "--activation-checkpointing", mode]) == 0
        memory[mode] = json.loads(capsys.readouterr().out)["layouts"][0]["memory_bytes"]["activations"]
    assert memory["full"] < memory["selective"] < memory["none"] and memory["every_n"] < memory["none"], memory


def test_cli_table_json_and_errors(capsys):
    sizes = ["--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "128", "--global-batch", "4"]
    assert main(["--devices", "2", "--vocab", "256", *sizes]) == 0
    table = capsys.readouterr().out
    assert "25.4M parameters" in table and "dp  dp_shard  pp  cp  tp" in table
    assert main(["--devices", "2", "--module", "lightning_4d.demos.gpt:GPT", "--init-args",
                 '{"n_layer": 8, "n_embd": 512, "n_head": 8}', "--seq", "128", "--global-batch", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == sum(p.numel() for p in GPT(n_layer=8, n_embd=512, n_head=8).parameters())
    fields = ("dp", "pp", "cp", "tp", "dp_shard")
    assert {tuple(e["layout"][f] for f in fields) for e in report["layouts"]} == {
        (2, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 2, 1, 1), (1, 1, 1, 2, 1), (1, 1, 1, 1, 2)}
    with pytest.raises(SystemExit) as exit_:
        main(["--devices", "2", "--vocab", "256", "--memory", "1MiB", *sizes])
    assert exit_.value.code == 2
    assert "error: no layout fits in 1.00 MiB per device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--devices", "2", "--seq", "128", "--global-batch", "4", "--hidden", "512"])
    assert "missing --layers --heads" in capsys.readouterr().err


# ------------------------------------------------------------------------- estimate vs measured

MEASURED_MODEL = dict(vocab_size=256, n_layer=8, n_head=8, n_embd=512, block_size=128)  # 25.4M parameters
SEQ, GLOBAL_BATCH = 128, 4
LAYOUTS = {1: [{}], 2: [{"dp": 2}, {"cp": 2}, {"tp": 2}, {"pp": 2}]}
_peak = PeakMemory(torch.device("cpu"))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def measured_gpt(**config):
    """The harness's module factory: fix malloc's mmap threshold (module docstring), restart the peak and take the
    baseline right before the model exists."""
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 131072):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the peak would count memory malloc keeps after frees")
    gc.collect()
    _peak.start()
    return GPT(**config)


def measured_tokens(train: bool = True):
    return token_data(train, size=16, seq_len=SEQ, vocab=MEASURED_MODEL["vocab_size"])


class PeakGrowth(Callback):
    """Every rank's peak resident memory above the baseline, read before the harness gathers full weights."""

    def on_train_end(self, trainer, pl_module):
        self.growth = _peak.growth()

    def parity_extras(self, trainer):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.growth)
        return {"peak_growth": everyone}


def _name(layout: dict) -> str:
    return "_".join(f"{dim}{size}" for dim, size in layout.items()) or "single"


@pytest.fixture(scope="module")
def measured_peaks():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to restart the peak resident-set size")
    peaks = {}
    for world_size, layouts in LAYOUTS.items():
        cases = [Case(_name(layout), module="tests.test_plan:measured_gpt", module_kwargs=MEASURED_MODEL,
                      data="tests.test_plan:measured_tokens", strategy=layout, batch_size=GLOBAL_BATCH,
                      max_steps=2, callbacks=["tests.test_plan:PeakGrowth"]) for layout in layouts]
        results = train_layout(cases, world_size, timeout=300)
        for layout, case in zip(layouts, cases):
            peaks[case.name] = (Layout(**layout), max(results[case.name]["extras"]["peak_growth"]))
    return peaks


def test_memory_estimate_is_within_20_percent_of_the_measured_peak(measured_peaks):
    model = Model.from_module(GPT(**MEASURED_MODEL))
    training = Training(seq_len=SEQ, global_batch=GLOBAL_BATCH)
    lines, errors = [], {}
    for name, (layout, measured) in measured_peaks.items():
        estimated = estimate(model, training, layout).memory["total"]
        errors[name] = estimated / measured - 1
        lines.append(f"{layout}: estimated {estimated / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB"
                     f" ({errors[name]:+.1%})")
    print("\n".join(lines))
    assert len(errors) >= 5
    assert all(abs(error) <= 0.2 for error in errors.values()), "\n".join(lines)


def test_cli_ranks_expert_parallel_layouts(capsys):
    """--experts (sizes) or an MoE --module: every (layout, ep) pair FourDStrategy accepts, ranked by model state per
    rank then all-to-all bytes; the figures are the planner's expert_estimate (checked against runs in
    tests/test_expert_parallel.py)."""
    from lightning_4d.planner import MoESizes, expert_estimate
    from tests.moe_models import HFMoELM

    common = ["--seq", "16", "--global-batch", "8"]
    assert main(["--devices", "2", "--module", "tests.moe_models:HFMoELM", "--init-args", '{"kind": "mixtral"}',
                 *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sizes = MoESizes.from_module(HFMoELM("mixtral"))
    assert report["moe"]["expert_params"] == sizes.expert_params == 12288
    rows = report["expert_layouts"]
    pairs = {(tuple(r["layout"][f] for f in ("dp", "dp_shard", "pp", "cp", "tp")), r["ep"]) for r in rows}
    assert pairs == {((2, 1, 1, 1, 1), 1), ((2, 1, 1, 1, 1), 2), ((1, 2, 1, 1, 1), 1), ((1, 2, 1, 1, 1), 2),
                     ((1, 1, 1, 2, 1), 1), ((1, 1, 1, 2, 1), 2), ((1, 1, 2, 1, 1), 1), ((1, 1, 1, 1, 2), 1)}
    states = [r["model_state_bytes"] for r in rows]
    assert states == sorted(states)
    ep2_dp2 = next(r for r in rows if r["ep"] == 2 and r["layout"]["dp"] == 2)
    assert ep2_dp2["expert_params"] == sizes.expert_params / 2
    assert ep2_dp2["ep_bytes"] == expert_estimate(sizes, 2, 8 // 2 * 16)["ep_bytes"] > 0
    assert all(r["ep_bytes"] == 0 for r in rows if r["ep"] == 1)

    sizes_args = ["--layers", "2", "--hidden", "512", "--heads", "8", "--vocab", "256", *common]
    assert main(["--devices", "4", *sizes_args, "--experts", "8", "--expert-ffn", "1024", "--ep", "4"]) == 0
    table = capsys.readouterr().out
    assert "2 MoE layers of 8 experts (hidden 512, inner 1024, top-2), 25.2M expert parameters" in table
    assert "ep traffic/step" in table and "6.29M" in table  # 25.2M experts over ep=4
    with pytest.raises(SystemExit):
        main(["--devices", "2", *sizes_args, "--experts", "8", "--ep", "3"])
    assert "no layout takes ep in [3]: ep must divide the 8 experts per layer and the layout's dp x cp" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--devices", "2", *sizes_args, "--ep", "2"])
    assert "--ep needs the experts: pass --experts N" in capsys.readouterr().err


def test_the_logits_are_counted_with_and_without_the_fused_head_loss(capsys):
    """Issue #39's configuration (vocabulary 32,000, 4,096 tokens per rank, fp32): unfused, the logits and their
    log-softmax, tokens x vocab x 8 bytes (1,000 MiB); fused, a chunk the size of the head's input (2^22 logits
    at least) three times over, the rows' gradient and the head's weight gradient; the chunk floor is the
    strategy's."""
    from lightning_4d.numerics.head_loss import MIN_CHUNK_ELEMENTS as STRATEGY_CHUNK
    from lightning_4d.planner.estimate import MIN_CHUNK_ELEMENTS

    assert MIN_CHUNK_ELEMENTS == STRATEGY_CHUNK
    sizes = ["--devices", "2", "--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "32000", "--seq", "4096",
             "--global-batch", "2", "--json"]
    logits = {}
    for fused in (True, False):
        assert main([*sizes] + ([] if fused else ["--no-fuse-lm-loss"])) == 0
        layouts = json.loads(capsys.readouterr().out)["layouts"]
        logits[fused] = {str(tuple(r["layout"].values())): r["memory_bytes"]["logits"] for r in layouts}
    dp2 = str((2, 1, 1, 1, 1))
    assert logits[False][dp2] == 4096 * 32000 * 8
    assert logits[True][dp2] == 2**22 * 12 + 4096 * 128 * 4 + 32000 * 128 * 4
    assert all(logits[True][k] < logits[False][k] / 10 for k in logits[True]), logits
    # GPipe's last stage holds every micro-batch's forward: the head forms its gradients in backward, keeping none
    kept = {}
    for schedule in ("gpipe", "1f1b"):  # a global batch of 4: pp=2's 4 micro-batches of one sequence each
        assert main([*sizes[:-2], "4", "--json", "--pp-schedule", schedule]) == 0
        layouts = json.loads(capsys.readouterr().out)["layouts"]
        kept[schedule] = {str(tuple(r["layout"].values())): r["memory_bytes"]["logits"] for r in layouts
                          if r["layout"]["pp"] == 2}
    pp2 = list(kept["gpipe"])
    assert pp2 and set(pp2) == set(kept["1f1b"]), kept
    for key in pp2:
        assert kept["gpipe"][key] == 2**22 * 12, (key, kept)
        assert kept["1f1b"][key] > kept["gpipe"][key], (key, kept)
    # a head whose 4 micro-batches' logits together fit in one chunk (2^20 each: 256 tokens x 4,096) runs
    # unfused under GPipe: the logits and their log-softmax; one token more per micro-batch, chunked again
    for seq, unfused in ((256, True), (257, False)):  # pp=2 of 2 devices: a micro-batch is one sequence
        small = ["--devices", "2", "--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "4096", "--seq",
                 str(seq), "--global-batch", "4", "--pp-schedule", "gpipe", "--json"]
        assert main(small) == 0
        got = {str(tuple(r["layout"].values())): r["memory_bytes"]["logits"]
               for r in json.loads(capsys.readouterr().out)["layouts"] if r["layout"]["pp"] == 2 and
               r["layout"]["tp"] == 1}
        assert got and all((v == seq * 4096 * 8) == unfused for v in got.values()), (seq, got)
