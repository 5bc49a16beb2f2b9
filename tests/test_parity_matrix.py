"""Every layout with dp, pp, cp, tp in {1, 2} (16 layouts, up to 16 processes) against one process.

Run alone with ``pytest -m parity_matrix``. Two models: the example GPT (rotary tables, RMSNorm, separate
q/k/v/o) and a Hugging Face LlamaForCausalLM from a tiny config (grouped K/V heads, HF rotary embedding
with position_ids). Losses per step and logged train_loss within 1e-5 relative, final weights within
1e-5 + 1e-5*|w|, after 4 SGD steps (see tests/lm_models.py for why SGD). The 2x2x2x2 GPT run also checkpoints
at step 2 and resumes in a new Trainer: the resumed run must equal the uninterrupted one bit for bit. Every
layout with dp=2 also trains the GPT with dp_shard=2 in its place (FSDP2 sharding instead of replicas; 8 layouts,
up to dp_shard2 x pp2 x cp2 x tp2). The full 4D layout also trains two families of the model zoo, GPT-NeoX and
Phi-3 (tests/zoo_models.py), 2 steps each, with activation checkpointing 'full' and 'selective'. The dp2 x pp2 x
cp2 layout also trains supervised fine-tuning batches (prompts masked with -100, tests/fine_tuning_models.py),
where per-rank means gave NaN before token-mean losses were weighted as one process weights them, and a BERT
encoder on masked-LM targets (tests/test_fine_tuning.py has the smaller layouts). The full 4D layout also
builds the tiny Llama on the meta device and fills it from a Hugging Face directory (with activation
checkpointing 'every_n') and from a state_dict file (``init_from``).
"""

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from tests.parity import (Case, assert_exact_resume, assert_parity, in_windows, reference, train_layout,
                          window_reference)

pytestmark = pytest.mark.parity_matrix

MODELS = {
    "gpt": dict(module="tests.lm_models:tiny_gpt"),
    "llama": dict(module="tests.lm_models:HFCausalLM", module_kwargs={"kind": "llama"}),
}
LAYOUTS = [dict(zip(("dp", "pp", "cp", "tp"), sizes)) for sizes in itertools.product((1, 2), repeat=4)]
# Two pipeline micro-batches (the fewest 1F1B takes at pp=2) rather than the default 2*pp: every micro-batch
# repeats each tensor- and context-parallel collective, and at 16 processes on 2 cores their latency is the step
# time (a 2x2x2x2 case takes half as long). Schedules with more micro-batches: tests/test_pipeline_parallel.py.
LAYOUTS = [dict(layout, pp_microbatches=2) if layout["pp"] == 2 else layout for layout in LAYOUTS]


RESUME_AT = 2  # the full 4D layout also checkpoints at this step and resumes from it in a new Trainer


def _name(layout: dict, model: str) -> str:
    return f"{model}-dp{layout['dp']}pp{layout['pp']}cp{layout['cp']}tp{layout['tp']}"


def _cases(world_size: int) -> list[Case]:
    layouts = [layout for layout in LAYOUTS if layout["dp"] * layout["pp"] * layout["cp"] * layout["tp"] == world_size]
    return [
        Case(_name(layout, model), data="tests.lm_models:token_data", strategy=layout, batch_size=8,
             max_steps=4, resume_at=RESUME_AT if world_size == 16 and model == "gpt" else None, **spec)
        for layout in layouts for model, spec in MODELS.items()
    ] + [  # sharded data parallelism in place of the replicas, in every layout that has dp=2
        Case(_name(layout, "gpt").replace("-dp2", "-dp_shard2"), data="tests.lm_models:token_data",
             strategy={**layout, "dp": 1, "dp_shard": 2}, batch_size=8, max_steps=4, **MODELS["gpt"])
        for layout in layouts if layout["dp"] == 2
    ]


# Two families of the model zoo (tests/test_zoo.py trains every family at dp, tp, cp and pp of 2, one at a time)
# also in the full 4D layout, two steps each: GPT-NeoX (q, k, v fused head by head, rotary on half of each head,
# parallel residual) and Phi-3 (fused qkv_proj and gate_up_proj); Llama is the matrix's own Hugging Face model.
# Each 4D case beyond the first three also checkpoints activations, one mode each (GPT-NeoX 'full', Phi-3
# 'selective', the meta-built Llama 'every_n': every second block counted over the whole model, so each pipeline
# stage checkpoints one of its two): two steps suffice, the second step's loss and the final weights already depend
# on the recomputed backward, and each 4D case costs 7-13 s at 16 processes on 2 cores.
ZOO_FAMILIES = {"gpt_neox": "full", "phi3": "selective"}
ZOO = [Case(f"zoo_{family}-dp2pp2cp2tp2-{mode}", module="tests.zoo_models:zoo_lm",
            module_kwargs={"family": family}, data="tests.lm_models:token_data",
            strategy={**LAYOUTS[-1], "activation_checkpointing": mode}, batch_size=8, max_steps=2)
       for family, mode in ZOO_FAMILIES.items()]


# Masked labels in three dimensions at once: micro-batches and sequence shards without a valid label.
FINE_TUNING = [Case("sft-dp2pp2cp2", module="tests.lm_models:tiny_gpt", data="tests.fine_tuning_models:sft_data",
                    strategy={"dp": 2, "pp": 2, "cp": 2, "pp_microbatches": 2}, batch_size=8, max_steps=3),
               Case("mlm-dp2pp2cp2", module="tests.fine_tuning_models:BertMLM", data="tests.fine_tuning_models:mlm_data",
                    strategy={"dp": 2, "pp": 2, "cp": 2, "pp_microbatches": 2}, batch_size=8, max_steps=3),
               # every valid label of an accumulation window weighted once: against one process on whole windows
               Case("sft-dp2pp2cp2-accumulate", module="tests.lm_models:tiny_gpt",
                    data="tests.fine_tuning_models:sft_data", strategy={"dp": 2, "pp": 2, "cp": 2, "pp_microbatches": 2},
                    trainer={"accumulate_grad_batches": 2}, batch_size=8, max_steps=2)]


def _pretrained(root: Path) -> tuple[list[Case], dict[str, Case]]:
    """The tiny Llama built on the meta device in the full 4D layout, no rank ever holding it whole, filled by
    ``init_from`` from a sharded Hugging Face directory and from a plain state_dict file (tests/test_pretrained.py
    and tests/test_meta_init.py have the smaller layouts); each case with the one-process run it must match:
    transformers' ``from_pretrained`` of the directory, and the whole model loading the file."""
    import lightning.pytorch as pl

    from tests.lm_models import HFCausalLM
    from tests.meta_models import whole_llama_state

    pl.seed_everything(4321, verbose=False)
    HFCausalLM(kind="llama").model.save_pretrained(root / "hf", max_shard_size="50KB")
    whole_llama_state(str(root / "state_dict.pt"))
    common = dict(module="tests.meta_models:meta_llama", data="tests.lm_models:token_data", batch_size=8, max_steps=2)
    hf = Case("meta_hf-dp2pp2cp2tp2-every_n",
              strategy={**LAYOUTS[-1], "init_from": str(root / "hf"), "activation_checkpointing": "every_n"}, **common)
    state = Case("meta_state_dict-dp2pp2cp2tp2", strategy={**LAYOUTS[-1], "init_from": str(root / "state_dict.pt")},
                 module_kwargs={"weights": str(root / "state_dict.pt")}, **common)
    one_process = {hf.name: replace(hf, module="tests.lm_models:pretrained_llama",
                                    module_kwargs={"path": str(root / "hf")}), state.name: state}
    return [hf, state], one_process


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_every_layout_matches_one_process(world_size, tmp_path):
    cases = _cases(world_size) + (ZOO if world_size == 16 else []) + (FINE_TUNING if world_size == 8 else [])
    pretrained, one_process = _pretrained(tmp_path) if world_size == 16 else ([], {})
    results = train_layout(cases + pretrained, world_size, timeout=900)
    for case in pretrained:
        assert_parity(case, reference(one_process[case.name]), results[case.name])
    for case in cases:
        got = results[case.name]
        if "accumulate_grad_batches" in case.trainer:
            assert_parity(case, window_reference(case), in_windows(case, got))
            continue
        assert_parity(case, reference(case), got)
        if case.resume_at:  # exact resume in 4D: bit for bit what the uninterrupted run did
            assert_exact_resume(got)
