"""Bad input across all four dimensions: a ValueError before any collective, naming the value and the fix.

Every check here runs in this process, in well under a second, with no process group: the validation the
strategy does before communicating is plain code. (End-to-end versions that show every rank stops, not
one, live in the per-dimension tests: test_tp_strategy, test_context_parallel, test_pipeline_parallel.)
"""

import lightning.pytorch as pl
import pytest
import torch

from lightning_4d import FourDStrategy
from lightning_4d.pipeline.config import PipelineConfig
from lightning_4d.pipeline.microbatch import split_batch
from lightning_4d.pipeline.split import check_blocks, find_blocks
from lightning_4d.ring_attention import zigzag_positions
from lightning_4d.tensor_parallel import plan_tensor_parallel
from tests.lm_models import HFCausalLM, tiny_gpt
from tests.models import Classifier

STRATEGY_ARGUMENTS = [
    # data parallel and sizes
    (dict(tp=0), r"tp=0 is not a valid size: use a positive integer"),
    (dict(cp=1.5), r"cp=1\.5 is not a valid size"),
    (dict(dp="all"), r"dp='all' is not a valid size: use a positive integer or 'auto'"),
    (dict(bucket_mb=0), r"bucket_mb=0 must be a positive number of megabytes"),
    (dict(tpp=2), r"unknown argument tpp=2: did you mean 'tp'\?"),
    (dict(debug_steps=0), r"debug_steps=0 must be a positive number of training steps"),
    # pipeline
    (dict(pp=2, pp_schedule="zigzag"), r"pp_schedule='zigzag' is not a known schedule: use one of gpipe, 1f1b"),
    (dict(pp=2, pp_microbatches=0), r"pp_microbatches=0 must be a positive integer \(default 2\*pp = 4\)"),
    (dict(pp=4, pp_microbatches=2), r"pp_microbatches=2 does not fit pp_schedule='1f1b': 1f1b needs at least pp=4"),
    (dict(pp=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=3),
     r"pp_virtual_stages=3 does not fit pp_schedule='zbv_zero_bubble': it needs exactly 2 stages per rank"),
    (dict(pp=2, pp_split_points=[3, 5]), r"pp_split_points=\[3, 5\] must be 1 strictly increasing positive block"),
    (dict(pp=2, pp_blocks=""), r"pp_blocks='' must be the dotted path of the block list"),
    # context parallel
    (dict(cp=2, cp_comm="ulysses"), r"cp_comm='ulysses' is not a communication mode: use 'ring'"),
    (dict(cp=2, cp_seq_dim=-1), r"cp_seq_dim=-1 must be the non-negative index of the sequence dim"),
    (dict(cp=2, cp_buffers="cos"), r"cp_buffers='cos' must be a list of names"),
    # tensor parallel
    (dict(tp=2, tp_plan=42), r"tp_plan=42: use 'auto', 'none' or a mapping of module globs to styles"),
    (dict(pp=2, tp=2, sequence_parallel=True), r"sequence_parallel=True with pp=2 is not supported"),
]


@pytest.mark.parametrize(("kwargs", "message"), STRATEGY_ARGUMENTS, ids=lambda v: str(v)[:40])
def test_strategy_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FourDStrategy(**kwargs)


def test_sizes_that_do_not_make_the_world_size():
    with pytest.raises(ValueError, match=r"dp\*pp\*cp\*tp = 2\*2\*1\*2 = 8 does not equal the world size 4"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=FourDStrategy(dp=2, pp=2, tp=2))


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
    with pytest.raises(ValueError, match=r"\(LlamaAttention\) has 2 key/value heads, not divisible by tp=4"):
        plan_tensor_parallel(HFCausalLM(kind="llama", heads=4, kv_heads=2), 4)


def test_context_parallel_length_not_divisible():
    with pytest.raises(ValueError, match=r"10.*2\*cp = 4.*8 or 12"):
        zigzag_positions(10, 2, 0)


def test_pipeline_module_that_cannot_be_split():
    config = PipelineConfig(pp=4)
    path, blocks = find_blocks(tiny_gpt(n_layer=2), None)
    with pytest.raises(ValueError, match=r"pp=4 with pp_schedule='1f1b' needs 4 stages, but model\.layers has only"
                                         r" 2 blocks\. Use pp <= 2"):
        check_blocks(blocks, path, config)
    with pytest.raises(ValueError, match=r"found no list of repeated blocks in Classifier.*pp_blocks"):
        find_blocks(Classifier(), None)
    with pytest.raises(ValueError, match=r"pp_blocks='model\.blocks' names no submodule"):
        find_blocks(tiny_gpt(), "model.blocks")


def test_batch_that_does_not_split_into_microbatches():
    with pytest.raises(ValueError, match=r"does not split into pp_microbatches=4 equal micro-batches"):
        split_batch((torch.zeros(6, 3), torch.zeros(6)), 4)


def test_fp16_grad_scaling_is_refused_before_launch():
    # Lightning's own check for this strategy family: a GradScaler cannot follow a pipeline schedule's backward.
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`\. Choose a"
                                         r" different precision among: 32-true, bf16-mixed, bf16-true, 16-true"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(pp=2), precision="16-mixed")


def test_single_machine_rendezvous_defaults_to_loopback(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(dp=2))
    assert trainer.strategy.cluster_environment.main_address == "127.0.0.1"
