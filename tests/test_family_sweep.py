"""The meta-device sweep (tests/family_sweep.py) over every causal-LM and masked-LM family of the installed
transformers: a row for each, every family built from its shrunk configuration (those left out are listed with
their reason in docs/zoo.md), the families issue #28 names planned with >= 90% of the body sharded, and
docs/zoo.md's table of the sweep current."""

from __future__ import annotations

import pytest

from tests.family_sweep import _families, sweep


@pytest.fixture(scope="module")
def rows():
    return {row.family: row for row in sweep()}


def test_every_family_has_a_row(rows):
    assert sorted(rows) == sorted(family for family, _, _ in _families()) and len(rows) > 100, len(rows)
    assert [row for row in rows.values() if not row.model] == []


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "deepseek_v3", "llama", "olmo2"])
def test_named_families_are_sharded(rows, family):
    share = rows[family].tp
    assert share.endswith("%") and int(share[:-1]) >= 90, (family, rows[family])


def test_docs_zoo_holds_the_sweep(rows):
    """docs/zoo.md's section for the installed transformers is the table written from this sweep."""
    import sys
    from pathlib import Path

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
    import zoo_table

    _, sections = zoo_table.sweep_sections(zoo_table.OUTPUT.read_text())
    ordered = [rows[family] for family, _, _ in _families()]
    assert sections.get(transformers.__version__) == zoo_table.render_sweep(ordered, transformers.__version__), (
        f"docs/zoo.md has no current sweep of transformers {transformers.__version__}: run python docs/zoo_table.py")
