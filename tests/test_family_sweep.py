"""The meta-device sweep (tests/family_sweep.py) over every causal-LM and masked-LM family of the installed
transformers. Its invariants, which hold for any transformers release: a row for each family; every family
built from its shrunk configuration plans or is refused by lightning-4d with a fix, never meets another error
(a crash, or a library's exception passing through); the families issue #28 names planned with >= 90% of the
body sharded. And docs/zoo.md holds the table of the sweep for the installed transformers where the page has a
section for it (``python docs/zoo_table.py`` writes it): a new release changes the page, not the suite's
verdict, unless a family starts meeting errors."""

from __future__ import annotations

import pytest
import torch

from tests.family_sweep import _families, sweep


@pytest.fixture(scope="module")
def rows():
    return {row.family: row for row in sweep()}


def test_every_family_has_a_row(rows):
    assert sorted(rows) == sorted(family for family, _, _ in _families()) and len(rows) > 100, len(rows)
    built = [row for row in rows.values() if row.model]
    assert len(built) > 100, [row for row in rows.values() if not row.model]  # a family not built is on the page


def test_every_family_plans_or_is_refused_with_a_fix(rows):
    errors = {family: [text for text in (row.tp, row.cp, row.pp, row.strict, row.fixed, row.pp_fixed)
                       if text.startswith("error: ")] for family, row in rows.items() if row.model}
    assert {family: texts for family, texts in errors.items() if texts} == {}


def test_a_refusal_is_lightning_4d_s_own_with_a_fix():
    from lightning_4d.tensor_parallel import TensorParallelConfig
    from tests.family_sweep import _verdict, is_refusal

    with pytest.raises(ValueError) as ours:
        TensorParallelConfig(2, "no-such-plan", False, True, True, False)
    assert is_refusal(ours.value), str(ours.value)

    def library_error():
        raise ValueError("use another size")  # a ValueError with a fix, raised outside lightning_4d

    assert _verdict(library_error).startswith("error: ValueError: use another size (")
    assert _verdict(lambda: torch.ones(2) @ torch.ones(3)).startswith("error: RuntimeError")


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "deepseek_v3", "llama", "olmo2"])
def test_named_families_are_sharded(rows, family):
    share = rows[family].tp
    assert share.endswith("%") and int(share[:-1]) >= 90, (family, rows[family])


def test_docs_zoo_holds_the_sweep(rows):
    """docs/zoo.md's section for the installed transformers, when it has one, is the table written from this
    sweep; a release the page has no section for is held to the invariants above only."""
    import sys
    from pathlib import Path

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
    import zoo_table

    _, sections = zoo_table.sweep_sections(zoo_table.OUTPUT.read_text())
    assert sections, "docs/zoo.md has no sweep section: run python docs/zoo_table.py"
    if transformers.__version__ not in sections:
        return
    ordered = [rows[family] for family, _, _ in _families()]
    assert sections.get(transformers.__version__) == zoo_table.render_sweep(ordered, transformers.__version__), (
        f"docs/zoo.md has no current sweep of transformers {transformers.__version__}: run python docs/zoo_table.py")


def test_tp_refusals_name_a_fix_that_plans(rows):
    """Each refused tp plan names a tp_plan that plans (the sweep applies them in turn), or ends at the refusal
    that nothing can be sharded automatically, which names tp=1."""
    refused = {family: row.fixed for family, row in rows.items() if row.tp.startswith("refused")}
    assert refused and all(row.fixed for row in rows.values() if row.tp.startswith("refused"))
    left = {family: fixed for family, fixed in refused.items()
            if not fixed.endswith("%") and "can be sharded automatically" not in fixed}
    assert left == {}, left


def test_refusals_name_the_true_cause(rows):
    """Zamba2's MLP holds low-rank adapters beside its fused gate|up projection; GPT-OSS's attention a sink per
    head; the attention-free families (state-space, recurrent, Fourier) have no attention for cp to split."""
    assert "has a linear model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.0.0 (64->128)" \
           " beside its projections gate_up_proj, down_proj (a branch" in rows["zamba2"].tp, rows["zamba2"].tp
    assert "has its own parameters sinks [4] that are neither" in rows["gpt_oss"].tp, rows["gpt_oss"].tp
    for family in ("mamba", "mamba2", "falcon_mamba", "xlstm", "fnet"):
        assert "holds no attention module" in rows[family].cp and "Use cp=1" in rows[family].cp, rows[family].cp


def test_pp_refusals_name_a_fix_that_plans(rows):
    """Each pp refusal that names a pp_blocks is cut again at that list by the sweep, and plans; every other pp
    refusal names pp=1 (the model has no list the pipeline can cut: its cause is in the message)."""
    refused = {family: row for family, row in rows.items() if row.pp.startswith("refused")}
    assert refused
    named = {family: row.pp_fixed for family, row in refused.items() if row.pp_fixed}
    assert all(fixed == "ok" for fixed in named.values()), named
    unnamed = {family: row.pp for family, row in refused.items() if not row.pp_fixed}
    assert all("Use pp=1" in text or "use pp=1" in text for text in unnamed.values()), unnamed


def test_zamba2_pp_refusal_names_its_shared_block_and_pp1():
    """Zamba2 (on the meta device, as the sweep builds it): its layers are of two types, and the hybrid layers
    share one transformer's weights. The adapter lists inside that transformer are not offered as the blocks;
    the refusal names model.layers and why it cannot be cut either (the shared weights on two stages), and
    pp=1; naming model.layers is refused with the same cause."""
    import transformers

    from lightning_4d.pipeline.config import PipelineConfig
    from lightning_4d.pipeline.plan import PipelinePlan
    from tests.family_sweep import _config

    config = _config("zamba2", "Zamba2ForCausalLM")
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.Zamba2ForCausalLM(config)
    with pytest.raises(ValueError) as refused:
        PipelinePlan.build(model, PipelineConfig(pp=2))
    message = str(refused.value)
    assert "adapter_list" not in message, message
    assert "module lists found: model.layers (ModuleList of 2 x Zamba2MambaDecoderLayer, 2 x Zamba2HybridLayer)." \
           " Its longest list, model.layers, cannot be cut either: pp=2: model.layers.1.shared_transformer." in message
    assert "stages 0 and 1 hold those blocks" in message and message.endswith("Use pp=1 (dp=N replicates the model"
                                                                              " instead).")
    with pytest.raises(ValueError, match=r"^pp=2: model\.layers\.1\.shared_transformer\.\S+ and model\.layers\.3\."
                                         r"shared_transformer\.\S+ are one parameter .*Use pp=1"):
        PipelinePlan.build(model, PipelineConfig(pp=2, blocks="model.layers"))
    # With both hybrid layers on one stage (pp_split_points past them) nothing is shared across stages.
    plan = PipelinePlan.build(model, PipelineConfig(pp=2, blocks="model.layers", split_points=(1,)))
    assert plan.bounds == ((0, 1), (1, 4)), plan.bounds
