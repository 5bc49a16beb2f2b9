"""The planner and the runtime accept and refuse the same layouts.

One table of layouts x models x batches. The planner's side is ``layout_problems`` on ``Model.from_module``;
the runtime's side is everything ``FourDStrategy`` checks before a step runs, called in this process without
launching anything: its constructor (the typed configs), the pipeline plan (``PipelinePlan.build``) and micro-batch
split, ``plan_tensor_parallel`` on the module, and the context-parallel sequence check. So the table runs
in seconds, and a rule added to one side only makes a row disagree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import pytest
import torch

from lightning_4d import FourDStrategy
from lightning_4d.context_parallel.config import ContextParallelConfig
from lightning_4d.pipeline import SCHEDULES, PipelineConfig, PipelinePlan
from lightning_4d.pipeline.microbatch import split_batch
from lightning_4d.planner import PP_SCHEDULES, Layout, Model, Training, layout_problems
from lightning_4d.planner.estimate import FORWARDS_FIRST
from lightning_4d.tensor_parallel import TensorParallelConfig, plan_tensor_parallel
from lightning_4d.tensor_parallel.discovery import find_regions
from tests.lm_models import HFCausalLM, NanoGPT, tiny_gpt
from tests.zoo_models import zoo_lm

MODELS = {
    "gpt": lambda: tiny_gpt(),  # 4 layers, 4 heads, width 32, vocab 64
    "gpt_3_heads": lambda: tiny_gpt(n_head=3, n_embd=48),
    "gpt_vocab_65": lambda: tiny_gpt(vocab_size=65),
    "gpt_2_layers": lambda: tiny_gpt(n_layer=2),
    "torch_transformer": lambda: zoo_lm("torch_transformer"),  # nn.MultiheadAttention: fused in_proj_weight
    "llama_2_kv_heads": lambda: HFCausalLM(kind="llama", heads=4, kv_heads=2),
    "llama_3_kv_heads": lambda: HFCausalLM(kind="llama", hidden=48, heads=12, kv_heads=3),
    "nanogpt": lambda: NanoGPT(),  # fused c_attn, tied embedding and head
    "gpt_bigcode": lambda: zoo_lm("gpt_bigcode"),  # multi-query: one key/value head in a fused c_attn
    "torchtitan": lambda: zoo_lm("torchtitan_llama3"),  # 4 heads, 2 key/value heads, wqkv fused by group
}


@functools.cache
def _module(name: str) -> torch.nn.Module:
    return MODELS[name]()  # every check is pure: one module serves every row


class Row(NamedTuple):
    model: str
    layout: tuple[int, int, int, int]  # dp, pp, cp, tp
    accepted: bool
    why: str = ""  # the refusal this row is about
    seq: int = 16
    batch: int = 8  # global batch
    sp: bool = False
    schedule: str = "1f1b"
    microbatches: Optional[int] = None


TABLE = [
    Row("gpt", (1, 1, 1, 2), True),
    Row("gpt", (1, 1, 1, 4), True),
    Row("gpt", (2, 1, 1, 2), True),
    Row("gpt", (1, 1, 1, 8), False, "heads"),
    Row("gpt_3_heads", (1, 1, 1, 2), False, "heads"),
    Row("gpt_3_heads", (2, 1, 1, 1), True),
    Row("gpt_vocab_65", (1, 1, 1, 2), False, "vocab"),
    Row("gpt_vocab_65", (2, 1, 2, 1), True),
    Row("llama_2_kv_heads", (1, 1, 1, 2), True),
    Row("llama_2_kv_heads", (1, 1, 1, 4), True),  # fewer key/value heads than tp: kept whole on every rank
    Row("llama_3_kv_heads", (1, 1, 1, 4), False, "kv heads"),  # 4 is neither a divisor nor a multiple of 3
    Row("gpt_bigcode", (1, 1, 1, 2), True),  # its one key/value head's k and v rows kept whole on every rank
    Row("gpt_bigcode", (1, 1, 1, 4), True, sp=True),
    Row("torchtitan", (1, 1, 1, 2), True),  # whole key/value groups of qkv_linear.wqkv per rank
    Row("torchtitan", (1, 1, 1, 4), True),  # its group's k and v rows whole on the two ranks reading them
    Row("torchtitan", (1, 1, 1, 8), False, "heads"),
    Row("llama_2_kv_heads", (1, 1, 2, 2), True, sp=True),
    Row("gpt", (1, 1, 2, 1), True),
    Row("gpt", (1, 1, 2, 1), False, "seq vs 2*cp", seq=10),
    Row("gpt", (1, 1, 1, 1), True, seq=11),  # no cp: any length
    Row("gpt", (1, 1, 2, 2), False, "seq vs 2*cp*tp", seq=12, sp=True),
    Row("gpt", (1, 1, 2, 2), True, seq=12),  # without sequence parallelism 2*cp is enough
    Row("gpt", (1, 1, 2, 2), True, seq=16, sp=True),
    Row("gpt", (1, 2, 1, 1), True),
    Row("gpt", (2, 2, 1, 1), True),
    Row("gpt", (2, 2, 1, 1), False, "batch vs micro-batches", batch=4),
    Row("gpt", (1, 2, 1, 1), False, "micro-batches vs schedule", microbatches=1),
    Row("gpt", (1, 2, 1, 1), False, "micro-batches vs schedule", batch=10, schedule="interleaved_1f1b",
        microbatches=5),
    Row("gpt", (1, 2, 1, 1), True, schedule="interleaved_1f1b"),
    Row("gpt", (1, 2, 1, 1), False, "micro-batches vs schedule", schedule="dualpipev", microbatches=2),
    Row("gpt", (1, 2, 1, 1), True, schedule="dualpipev", microbatches=4),
    Row("gpt_2_layers", (1, 2, 1, 1), True),
    Row("gpt_2_layers", (1, 2, 1, 1), False, "too few blocks", schedule="interleaved_1f1b"),
    Row("gpt_2_layers", (1, 4, 1, 1), False, "too few blocks"),
    Row("gpt", (1, 2, 1, 2), True),
    Row("gpt", (1, 2, 1, 2), False, "sp with pp", sp=True),
    Row("nanogpt", (1, 1, 1, 2), True, sp=True),
    Row("nanogpt", (1, 2, 2, 1), True),
    Row("torch_transformer", (1, 1, 1, 2), True),  # in_proj_weight sharded by heads, out_proj row-wise
    Row("torch_transformer", (1, 1, 1, 4), True),
    Row("torch_transformer", (1, 1, 1, 8), False, "heads"),  # 4 heads
    Row("torch_transformer", (1, 1, 2, 2), True),
]


def _planner(row: Row) -> list[str]:
    dp, pp, cp, tp = row.layout
    training = Training(seq_len=row.seq, global_batch=row.batch, sequence_parallel=row.sp,
                        pp_schedule=row.schedule, microbatches=row.microbatches)
    return layout_problems(Model.from_module(_module(row.model)), training, Layout(dp, pp, cp, tp))


def _runtime(row: Row) -> Optional[str]:
    """The first refusal of the runtime's checks, in the order a run meets them; None when it would run."""
    dp, pp, cp, tp = row.layout
    module = _module(row.model)
    try:
        FourDStrategy(dp=dp, pp=pp, cp=cp, tp=tp, sequence_parallel=row.sp, pp_schedule=row.schedule,
                      pp_microbatches=row.microbatches)
        tensor_parallel = TensorParallelConfig(tp, sequence_parallel=row.sp)
        if pp > 1:
            pipeline = PipelineConfig(pp, row.schedule, row.microbatches)
            PipelinePlan.build(module, pipeline)
            split_batch(torch.zeros(row.batch // dp, row.seq), pipeline.num_microbatches)
        if tp > 1:
            plan_tensor_parallel(module, tp, sequence_parallel=row.sp)
        if cp > 1:
            ContextParallelConfig(cp).check_sequence_length(row.seq, tensor_parallel.sequence_shards)
    except ValueError as error:
        return str(error)
    return None


def test_the_table_covers_every_kind_of_refusal():
    assert len(TABLE) >= 20 and len({row.model for row in TABLE}) >= 5
    kinds = {row.why for row in TABLE if not row.accepted}
    assert kinds == {"heads", "kv heads", "vocab", "seq vs 2*cp", "seq vs 2*cp*tp", "batch vs micro-batches",
                     "micro-batches vs schedule", "too few blocks", "sp with pp"}
    assert all(row.accepted == (row.why == "") for row in TABLE)


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r.model}-{'x'.join(map(str, r.layout))}-{r.why or 'ok'}"
                         + (f"-seq{r.seq}" if r.seq != 16 else "") + ("-sp" if r.sp else "")
                         + (f"-{r.schedule}" if r.schedule != "1f1b" else "")
                         + (f"-m{r.microbatches}" if r.microbatches else "") + (f"-b{r.batch}" if r.batch != 8 else ""))
def test_planner_and_runtime_agree(row):
    planner, runtime = _planner(row), _runtime(row)
    assert (not planner) == row.accepted, f"planner: {planner}"
    assert (runtime is None) == row.accepted, f"runtime: {runtime}"


def test_planner_schedules_are_the_pipelines():
    assert sorted(PP_SCHEDULES) == sorted(SCHEDULES)
    assert sorted(FORWARDS_FIRST) == sorted(name for name, spec in SCHEDULES.items() if spec.forwards_first)


def test_planner_counts_heads_as_tensor_parallelism_does():
    """Key/value heads from the projections' shapes, as the runtime counts them, not from attribute names."""
    llama = _module("llama_2_kv_heads")
    model = Model.from_module(llama)
    (attention,) = [r for f, r in find_regions(llama).items() if r.kind == "attention" and ".layers.0." in f + "."]
    assert (model.heads, model.kv_heads) == (attention.heads, attention.kv_heads) == (4, 2)


@pytest.mark.parametrize(("name", "tp", "attention", "held"), [
    ("gpt_bigcode", 2, "model.transformer.h.0.attn", 2 * 32 * 8),  # its one key/value head: k and v whole
    ("torchtitan", 4, "model.layers.0.attention", 2 * 32 * 8),  # of 2 key/value heads, the rank's one
])
def test_planner_counts_the_fused_key_value_rows_kept_whole_as_the_runtime_holds_them(name, tp, attention, held):
    """The planner's weight matrices of a block on one rank are what the runtime's shards hold, with fewer
    key/value heads than tp: of the fused q|k|v projection, the k and v rows of the key/value head each rank
    reads (``permutation`` lists the rows the ranks hold)."""
    from lightning_4d.planner.estimate import _replicated_kv

    module = _module(name)
    model, plan = Model.from_module(module), plan_tensor_parallel(module, tp)
    region = plan.regions[attention]
    fused = f"{attention}.{region.inputs[0]}."
    block = module.get_submodule(attention.rsplit(".", 1)[0])
    local = 0
    for param_name, param in block.named_parameters(prefix=attention.rsplit(".", 1)[0]):
        if param.dim() < 2:
            continue  # the planner counts vectors whole
        if param_name.startswith(fused):
            local += param.numel() * len(region.fused.permutation(tp)) // sum(region.fused.widths()) // tp
        else:
            local += param.numel() // tp
    kv = _replicated_kv(model, tp)
    assert model.fused_qkv and _replicated_kv(model, tp, held=True) == held
    assert (model.layer_matrix_params - kv) / tp + held == local, (model, local)


@pytest.mark.parametrize("tp", [2, 4])
def test_planner_counts_torch_multihead_attention_as_the_runtime_shards_it(tp):
    """nn.TransformerEncoderLayer at tp: every weight matrix of a block is in a module the plan shards (the
    nn.MultiheadAttention's fused in_proj_weight by heads, out_proj, linear1, linear2), so a rank holds 1/tp of
    them, as the planner counts; and the planner reads the head count the runtime divides."""
    module = _module("torch_transformer")
    model, plan = Model.from_module(module), plan_tensor_parallel(module, tp)
    sharded = [fqn for fqn, style in plan.styles.items() if style.style in ("colwise", "rowwise")]
    local = 0
    for name, param in module.encoder.layers[0].named_parameters(prefix="encoder.layers.0"):
        if param.dim() >= 2:
            assert any(name.startswith(fqn + ".") for fqn in sharded), name
            local += param.numel() // tp
    attention = module.encoder.layers[0].self_attn
    assert model.heads == attention.num_heads == 4 and model.layer_matrix_params / tp == local, (model, local)
    assert plan.styles["encoder.layers.0.self_attn"].role == "multihead"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda: TensorParallelConfig(2, plan=42), r"tp_plan=42: use 'auto', 'none' or a mapping"),
        (lambda: TensorParallelConfig(0), r"tp=0 is not a valid size"),
        (lambda: TensorParallelConfig(2, sequence_parallel=1), r"sequence_parallel=1 must be true or false"),
        (lambda: TensorParallelConfig(2, sequence_parallel=True).check_with_pipeline(2),
         r"sequence_parallel=True with pp=2 is not supported"),
        (lambda: TensorParallelConfig(2, sequence_parallel=True).check_with_pipeline(PipelineConfig(4).pp),
         r"sequence_parallel=True with pp=4 is not supported"),
        (lambda: ContextParallelConfig(2, comm="ulysses"), r"cp_comm='ulysses' is not a communication mode"),
        (lambda: ContextParallelConfig(2, batch_keys="input_ids"), r"cp_batch_keys='input_ids' must be a list"),
        (lambda: ContextParallelConfig(-2), r"cp=-2 is not a valid size"),
        (lambda: ContextParallelConfig(2).check_sequence_length(12, TensorParallelConfig(2, sequence_parallel=True).sequence_shards),
         r"multiples of 2\*cp\*tp = 2\*2\*2 = 8, but the batch has length 12"),
    ],
)
def test_typed_configs_refuse_with_the_argument_and_fix(config, message):
    with pytest.raises(ValueError, match=message):
        config()


def test_typed_configs_hold_their_values():
    tp = TensorParallelConfig(2, {"lm_head": "replicate"}, sequence_parallel=True, loss_parallel=False)
    assert tp.enabled and tp.sequence_shards == 2
    assert tp.plan_kwargs() == dict(tp_plan={"lm_head": "replicate"}, sequence_parallel=True, loss_parallel=False)
    assert TensorParallelConfig(2, "none", sequence_parallel=True).sequence_shards == 1  # off: nothing to shard
    tp.check_with_pipeline(PipelineConfig(1).pp)  # sequence parallelism without a pipeline: no refusal
    TensorParallelConfig(2).check_with_pipeline(4)  # a pipeline without sequence parallelism: no refusal
    cp = ContextParallelConfig(4, batch_keys=["input_ids", 0])
    assert cp.batch_keys == ("input_ids", 0) and cp.sequence_multiple(tp.sequence_shards) == 16 and cp.sequence_multiple() == 8
