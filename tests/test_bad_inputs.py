"""Bad input across all four dimensions: a ValueError before any collective, naming the value and the fix.

Every check here runs in this process, in well under a second, with no process group: the validation the
strategy does before communicating is plain code. (End-to-end versions that show every rank stops, not
one, live in the per-dimension tests: test_tp_strategy, test_context_parallel.)
"""

from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_4d import FourDStrategy
from lightning_4d.pipeline.microbatch import split_batch
from lightning_4d.context_parallel.zigzag import zigzag_positions
from lightning_4d.tensor_parallel import plan_tensor_parallel
from tests import tp_models as M
from tests.lm_models import HFCausalLM, tiny_gpt
from tests.models import Classifier

STRATEGY_ARGUMENTS = [
    # data parallel and sizes
    (dict(tp=0), r"tp=0 is not a valid size: use a positive integer\."),
    (dict(pp=-1), r"pp=-1 is not a valid size"),
    (dict(cp=1.5), r"cp=1\.5 is not a valid size"),
    (dict(dp="all"), r"dp='all' is not a valid size: use a positive integer or 'auto'"),
    (dict(dp=True), r"dp=True is not a valid size"),
    (dict(bucket_mb=0), r"bucket_mb=0 must be a positive number of megabytes"),
    (dict(tpp=2), r"unknown argument tpp=2: did you mean 'tp'\?"),
    (dict(data_parallel_size=2), r"unknown argument data_parallel_size=2: "),
    (dict(debug_steps=0), r"debug_steps=0 must be a positive number of training steps"),
    # pipeline
    (dict(pp=2, pp_schedule="zigzag"), r"pp_schedule='zigzag' is not a known schedule: use one of gpipe, 1f1b"),
    (dict(pp=2, pp_schedule="zero_bubble"),
     r"pp_schedule='zero_bubble' is not a known schedule: use one of gpipe, 1f1b, interleaved_1f1b"),
    (dict(pp=2, pp_microbatches=0), r"pp_microbatches=0 must be a positive integer \(default 2\*pp = 4\)"),
    (dict(pp=2, pp_microbatches=1), r"pp_microbatches=1 does not fit pp_schedule='1f1b': 1f1b needs at least pp=2"),
    (dict(pp=4, pp_microbatches=2), r"pp_microbatches=2 does not fit pp_schedule='1f1b': 1f1b needs at least pp=4"),
    (dict(pp=2, pp_schedule="dualpipev", pp_microbatches=3),
     r"dualpipev needs at least as many micro-batches as stages \(4\)"),
    (dict(pp=2, pp_schedule="gpipe", pp_virtual_stages=2), r"pp_virtual_stages=2 does not fit pp_schedule='gpipe'"),
    (dict(pp=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=3),
     r"pp_virtual_stages=3 does not fit pp_schedule='zbv_zero_bubble': it needs exactly 2 stages per rank"),
    (dict(pp=2, pp_split_points=[3, 5]), r"pp_split_points=\[3, 5\] must be 1 strictly increasing positive block"),
    (dict(pp=2, pp_split_points=[3, 2]), r"pp_split_points=\[3, 2\] must be 1 strictly increasing"),
    (dict(pp=2, pp_blocks=""), r"pp_blocks='' must be the dotted path of the block list"),
    # context parallel
    (dict(cp=2, cp_comm="ulysses"), r"cp_comm='ulysses' is not a communication mode: use 'ring'"),
    (dict(cp=2, cp_comm="nccl"), r"cp_comm='nccl' is not a communication mode"),
    (dict(cp=2, cp_seq_dim=-1), r"cp_seq_dim=-1 must be the non-negative index of the sequence dim"),
    (dict(cp=2, cp_batch_keys="input_ids"), r"cp_batch_keys='input_ids' must be a list"),
    (dict(cp=2, cp_buffers="cos"), r"cp_buffers='cos' must be a list of names"),
    (dict(cp=2, cp_buffers=[1.5]), r"cp_buffers=\[1\.5\] must be a list of names"),
    # tensor parallel
    (dict(tp=2, tp_plan=42), r"tp_plan=42: use 'auto', 'none' or a mapping of module globs to styles"),
    (dict(tp=2, tp_plan="everything"), r"tp_plan='everything': use 'auto', 'none' or a mapping"),
    (dict(pp=2, tp=2, sequence_parallel=True), r"sequence_parallel=True with pp=2 is not supported"),
    (dict(tp=2, loss_parallel="yes"), r"loss_parallel='yes' must be true or false"),
    (dict(tp=2, tp_self_check=None), r"tp_self_check=None must be true or false"),
]


@pytest.mark.parametrize(("kwargs", "message"), STRATEGY_ARGUMENTS, ids=lambda v: str(v)[:40])
def test_strategy_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FourDStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "devices", "message"),
    [
        (dict(dp=2, pp=2, tp=2), 4, r"dp\*pp\*cp\*tp = 2\*2\*1\*2 = 8 does not equal the world size 4"),
        (dict(dp=2, tp=2), 2, r"dp\*pp\*cp\*tp = 2\*1\*1\*2 = 4 does not equal the world size 2"),
        (dict(pp=3), 4, r"dp='auto' needs the world size \(4\) to be a multiple of pp\*cp\*tp = 3\*1\*1 = 3"),
        (dict(dp=3), 2, r"does not equal the world size 2 .*Set dp='auto'"),
    ],
)
def test_sizes_that_do_not_make_the_world_size(kwargs, devices, message):
    # Raised while the Trainer is built in the launching process: no process was started, no collective ran.
    with pytest.raises(ValueError, match=message):
        pl.Trainer(accelerator="cpu", devices=devices, strategy=FourDStrategy(**kwargs))


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (lambda: tiny_gpt(n_head=3, n_embd=48),
         r"model\.layers\.0\.attn \(CausalSelfAttention\) has 3 attention heads, not divisible by tp=2\. Fix:"),
        (lambda: tiny_gpt(vocab_size=65),
         r"Vocabulary size 65 of model\.tok_emb is not divisible by tp=2\. Fix: pad the vocabulary"),
        (lambda: Classifier(),
         r"tp=2 but nothing in Classifier can be sharded automatically(.|\n)*net\.0 \(Linear 16->32\)(.|\n)*Fix:"),
    ],
    ids=["heads", "vocabulary", "nothing_to_shard"],
)
def test_tensor_parallel_module_that_cannot_be_split(module, message):
    with pytest.raises(ValueError, match=message):
        plan_tensor_parallel(module(), 2)


def test_tensor_parallel_user_plan_errors():
    with pytest.raises(ValueError, match=r"tp_plan entry 'model\.layers\.\*\.attn\.q_proj': unknown style 'diagonal'"):
        plan_tensor_parallel(tiny_gpt(), 2, {"model.layers.*.attn.q_proj": "diagonal"})
    with pytest.raises(ValueError, match=r"tp_plan key 'model\.layer\.\*\.attn\.q_proj' matches no module\. Close"):
        plan_tensor_parallel(tiny_gpt(), 2, {"model.layer.*.attn.q_proj": "colwise"})
    with pytest.raises(ValueError, match=r"\(LlamaAttention\) has 3 key/value heads, not divisible by tp=4, and"):
        plan_tensor_parallel(HFCausalLM(kind="llama", hidden=48, heads=12, kv_heads=3), 4)


VOCAB = 64


def _lit(**overrides) -> nn.Module:
    config = M.LitConfig(VOCAB, n_query_groups=4)
    config.__dict__.update(overrides)
    return M.LitGPT(config)


@pytest.mark.parametrize(
    "model, tp, tp_plan, needles",
    [
        (lambda: M.TinyGPT(VOCAB, dim=32, n_head=4), 8, "auto", ["layers.0.attn", "4 attention heads", "tp=8"]),
        (lambda: M.MetaLlama(VOCAB, dim=48, n_heads=12, n_kv_heads=3), 4, "auto",
         ["layers.0.attention", "3 key/value heads"]),
        (lambda: M.TinyGPT(65), 2, "auto", ["Vocabulary size 65", "tok_emb", "replicate"]),
        (lambda: _lit(intermediate_size=34), 4, "auto", ["transformer.h.0.mlp", "intermediate size 34"]),
        (lambda: M.TinyGPT(VOCAB, attention=M.CustomHeadsAttention), 2, "auto",
         ["head count of attention layers.0.attn", "divide"]),
        (M.PlainMLPStack, 2, "auto", ["nothing in PlainMLPStack", "net.0 (Linear 8->16)", "tp_plan:"]),
        (M.TorchEncoder, 8, "auto", ["layers.0.self_attn (MultiheadAttention) has 4 attention heads", "tp=8",
                                     "'layers.*.self_attn': replicate"]),
        (lambda: M.TorchEncoder(add_bias_kv=True), 2, "auto",
         ["tp=2: layers.0.self_attn is an nn.MultiheadAttention with add_bias_kv=True", "'layers.*.self_attn': replicate"]),
        (lambda: M.TorchEncoder(add_zero_attn=True), 2, "auto", ["with add_zero_attn=True", "replicate"]),
        (lambda: M.TorchEncoder(kdim=16, vdim=16), 2, "auto", ["kdim=16/vdim=16 unlike embed_dim=32", "replicate"]),
        (M.TinyGPT, 2, {"layers.*.attn.q_proj": "columnwise"}, ["columnwise", "colwise, rowwise"]),
        (M.TinyGPT, 2, {"layer.*.attn.q_proj": "colwise"}, ["matches no module", "layers.0.attn.q_proj"]),
        (M.TinyGPT, 2, {"layers.*.norm1": "colwise"}, ["layers.0.norm1", "RMSNorm"]),
        (M.TinyGPT, 2, {"layers.*.norm1": "sequence_parallel"}, ["sequence_parallel=True"]),
        (M.TinyGPT, 2, {"layers.*.attn": {"style": "colwise", "output": "shard"}}, ["'shard'"]),
        (M.NanoGPT, 2, {"lm_head": "replicate"}, ["Tied parameters", "lm_head.weight", "transformer.wte.weight"]),
        (M.TinyGPT, 2, "everything", ["tp_plan must be"]),
    ],
)
def test_tensor_parallel_plan_errors_on_other_code_bases(model, tp, tp_plan, needles):
    """tests/tp_models.py: the module styles of nanoGPT, LitGPT, Meta's Llama, torch's encoder and others."""
    with pytest.raises(ValueError) as info:
        plan_tensor_parallel(model(), tp, tp_plan)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_torch_multihead_attention_is_sharded_by_heads_and_refuses_sequence_parallel():
    """The fix of each refusal above: tp dividing the heads shards nn.MultiheadAttention by heads (in_proj and
    out_proj) and the feed-forward beside it; a replicated one stays whole. Sequence parallelism is refused."""
    plan = plan_tensor_parallel(M.TorchEncoder(), 2)
    assert plan.styles["layers.0.self_attn"].style == "colwise" and plan.styles["layers.0.self_attn"].role == "multihead"
    assert plan.styles["layers.0.self_attn.out_proj"].style == "rowwise"
    assert plan.regions["layers.0"].inputs == ("linear1",) and plan.coverage.share > 0.98
    kept = plan_tensor_parallel(M.TorchEncoder(add_bias_kv=True), 2, {"layers.*.self_attn": "replicate"})
    assert "layers.0.self_attn" not in kept.styles and kept.coverage.share < 0.5
    with pytest.raises(ValueError, match=r"sequence_parallel=True: layers.0.self_attn is an nn.MultiheadAttention.*"
                                         r"Use sequence_parallel=False"):
        plan_tensor_parallel(M.TorchEncoder(), 2, sequence_parallel=True)


@pytest.mark.parametrize(
    ("seq_len", "cp", "pattern"),
    [
        (10, 2, r"length 10 .*2\*cp = 4.*8 or 12"),
        (2, 2, r"length 2 .*2\*cp = 4.*to 4$"),
        (13, 3, r"length 13 .*2\*cp = 6.*12 or 18"),
    ],
)
def test_context_parallel_length_not_divisible(seq_len, cp, pattern):
    with pytest.raises(ValueError, match=pattern):
        zigzag_positions(seq_len, cp, 0)


def _setup_environment(module, devices=2, **strategy):
    """Build the Trainer in this process and run the strategy's environment setup, which checks the module
    before creating any process group (the short timeout turns a missing check into a failure, not a hang)."""
    trainer = pl.Trainer(accelerator="cpu", devices=devices, logger=False,
                         strategy=FourDStrategy(init_timeout=timedelta(seconds=5), **strategy))
    trainer.strategy.connect(module)
    trainer.strategy.setup_environment()


def test_pipeline_with_more_stages_than_blocks():
    with pytest.raises(ValueError, match=r"pp=4 with pp_schedule='1f1b' needs 4 stages, but model\.layers has only 2"
                                         r" blocks\. Use pp <= 2"):
        _setup_environment(tiny_gpt(n_layer=2), devices=4, pp=4)
    with pytest.raises(ValueError, match=r"needs 8 stages \(2 stages per rank\), but model\.layers has only 4"):
        _setup_environment(tiny_gpt(n_layer=4), devices=4, pp=4, pp_schedule="interleaved_1f1b")


def test_pipeline_module_without_a_block_list_is_refused_with_the_candidates():
    with pytest.raises(ValueError, match=r"found no list of repeated blocks in Classifier .* net \(Sequential of"
                                         r" 3 x Linear, 2 x Tanh\)\. If the modules of net run one after another on"
                                         r" one activation, name it: FourDStrategy\(pp_blocks='net'\)"):
        _setup_environment(Classifier(), pp=2)
    with pytest.raises(ValueError, match=r"pp_blocks='model\.blocks' names no submodule of TinyGPT; .*model\.layers"):
        _setup_environment(tiny_gpt(), pp=2, pp_blocks="model.blocks")


def test_pipeline_with_manual_optimization_is_refused():
    module = tiny_gpt()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match=r"FourDStrategy\(pp=2\) needs automatic optimization, but"
                                         r" TinyGPT\.automatic_optimization is False"):
        _setup_environment(module, pp=2)


@pytest.mark.parametrize(
    ("batch", "shapes"),
    [
        ((torch.zeros(6, 3), torch.zeros(6)), r"\(6, 3\), \(6,\)"),
        ((torch.arange(18).view(6, 3), torch.arange(18).view(6, 3)), r"\(6, 3\)"),  # each shape named once
    ],
)
def test_batch_that_does_not_split_into_microbatches(batch, shapes):
    with pytest.raises(ValueError, match=r"does not split into pp_microbatches=4 equal micro-batches: tensors of"
                                         rf" shape {shapes} have .* multiple of 4"):
        split_batch(batch, 4)


def test_fp16_grad_scaling_is_refused_before_launch():
    # Lightning's own check for this strategy family: a GradScaler cannot follow a pipeline schedule's backward.
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`\. Choose a"
                                         r" different precision among: 32-true, bf16-mixed, bf16-true, 16-true"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(pp=2), precision="16-mixed")


def test_single_machine_rendezvous_defaults_to_loopback(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(dp=2))
    assert trainer.strategy.cluster_environment.main_address == "127.0.0.1"
