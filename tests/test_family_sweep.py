"""The meta-device sweep (tests/family_sweep.py) over every causal-LM and masked-LM family of the installed
transformers: a row for each, and the families issue #28 names planned with >= 90% of the body sharded."""

from __future__ import annotations

import pytest

from tests.family_sweep import _families, sweep


@pytest.fixture(scope="module")
def rows():
    return {row.family: row for row in sweep()}


def test_every_family_has_a_row(rows):
    assert sorted(rows) == sorted(family for family, _, _ in _families()) and len(rows) > 100, len(rows)


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "deepseek_v3", "llama", "olmo2"])
def test_named_families_are_sharded(rows, family):
    share = rows[family].tp
    assert share.endswith("%") and int(share[:-1]) >= 90, (family, rows[family])
