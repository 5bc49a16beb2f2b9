"""What the zoo's other-library families (litgpt's ``GPT``, torchtitan's Llama 3) need from context
parallelism beyond parity, which tests/test_zoo.py checks under each dimension with the rest of the zoo: their
rotary tables are found, and torchtitan's FlexAttention and varlen attention are refused before any collective.
"""

from __future__ import annotations


def test_context_parallelism_finds_torchtitans_rotary_cache():
    """torchtitan's RoPE modules keep their table as ``rope.cache`` and slice ``cache[0:seqlen]``: without the
    swap each cp rank would rotate its zigzag shard as if it started the sequence (its cp2 case in test_zoo.py differs
    from one process by ~1e-5 in a weight then, too little to see in a loss at this size)."""
    from lightning_4d.context_parallel import find_position_buffers
    from tests.zoo_models import zoo_lm

    assert find_position_buffers(zoo_lm("torchtitan_llama3")) == [f"model.layers.{i}.attention.rope.cache"
                                                                   for i in range(4)]
    assert find_position_buffers(zoo_lm("litgpt_llama")) == ["model.cos", "model.sin"]


def test_context_parallelism_refuses_torchtitans_flex_and_varlen_attention_before_any_collective():
    """torchtitan's default inner attention is FlexAttention (``model_registry(flavor, attn_backend="flex")``),
    and it has VarlenAttention: neither calls F.scaled_dot_product_attention, so at cp=2 each rank would attend
    over its own shard only. Refused from the modules' code, naming the module and the fix; the SDPA build (the
    fix, trained at cp=2 in test_zoo.py) passes."""
    import pytest
    from torchtitan.models.common import ScaledDotProductAttention
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    from lightning_4d.context_parallel import check_attention_reachable
    from tests.zoo_models import LIBRARY_FAMILIES, _torchtitan_llama3_config, zoo_lm

    def build(inner):
        config = _torchtitan_llama3_config()
        for layer in config.layers:
            layer.attention.inner_attention = inner
        return config.build()

    for inner, kernel in ((FlexAttention.Config(), "torch.nn.attention.flex_attention.flex_attention"),
                          (VarlenAttention.Config(), "torch.nn.attention.varlen.varlen_attn")):
        name = type(inner).__qualname__.split(".")[0]
        with pytest.raises(ValueError) as refused:
            check_attention_reachable(build(inner), 2)
        assert str(refused.value).startswith(
            f"cp=2: layers.0.attention.inner_attention ({name}) computes attention with {kernel} (4 in Llama3Model),"
            " not through torch.nn.functional.scaled_dot_product_attention"), refused.value
        assert ("model_registry(flavor, attn_backend='sdpa'), i.e. inner_attention=ScaledDotProductAttention.Config()),"
                " or use cp=1") in str(refused.value)
    check_attention_reachable(build(ScaledDotProductAttention.Config()), 2)
    for family in LIBRARY_FAMILIES:
        check_attention_reachable(zoo_lm(family), 2)
