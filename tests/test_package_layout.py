"""The package's layout is its architecture: one package per dimension, each importing only the shared modules
(``parallel_dims`` and the small helpers at the root, ``_compat/``, ``numerics/`` and ``modules/``) and its own
modules, never another dimension nor the composition; no import cycle anywhere. Read from the source with ``ast`` by ``docs/package_graph.py``
(every import statement counts, lazy ones and ``TYPE_CHECKING`` ones too), which also draws docs/packages.md."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
import package_graph as layout  # noqa: E402

# The ``python -m`` names kept for users; each only hands over to its package.
ENTRY_MODULES = {"plan": "planner", "export": "checkpoint", "verify_checkpoint": "checkpoint"}


def test_no_import_cycle():
    assert layout.cycles(layout.graph()) == []


def test_the_cycle_finder_finds_one():
    assert layout.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("dimension", layout.DIMENSIONS)
def test_a_dimension_imports_only_shared_modules_and_its_own(dimension):
    assert (layout.PACKAGE / dimension / "__init__.py").is_file(), f"lightning_4d/{dimension}/ is not a package"
    wrong = {}
    for module, imported in layout.graph().items():
        if layout.package_of(module) != dimension:
            continue
        for target in imported:
            home = layout.package_of(target)
            if (target in layout.COMPOSITION or home == "composition"
                    or (home is not None and home not in (dimension, *layout.SHARED_PACKAGES))):
                wrong.setdefault(module, []).append(target)
    assert wrong == {}, f"{dimension} reaches outside its package and the shared modules: {wrong}"


def test_the_rule_sees_lazy_and_type_checking_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("if False:\n    from lightning_4d.pipeline import config\n"
                     "def f():\n    from lightning_4d.tensor_parallel.plan import ModuleStyle\n")
    assert layout.imports(probe, layout.modules()) == {"lightning_4d.pipeline.config",
                                                       "lightning_4d.tensor_parallel.plan"}
    assert layout.package_of("lightning_4d.pipeline.config") == "pipeline"
    assert layout.package_of("lightning_4d.arguments") is None


def test_root_modules_are_not_pieces_of_a_package():
    """What moved into a package has no root module left behind, and the kept command-line names only hand over
    to their package (imports and the ``__main__`` call, nothing defined)."""
    for old in ("context_parallel_config", "ring_attention", "_attention_kernels", "fsdp", "resumable_loader",
                "plan_model", "plan_cli", "parallelize", "block_units", "materialize", "weight_agreement",
                "token_losses", "step_logging", "clipping", "activation_checkpointing", "compile", "telemetry",
                "desync", "experts", "multihead_attention"):
        assert not (layout.PACKAGE / f"{old}.py").exists(), old
    for entry, package in ENTRY_MODULES.items():
        path = layout.PACKAGE / f"{entry}.py"
        tree = ast.parse(path.read_text())
        defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        assert defined == [], f"lightning_4d/{entry}.py defines {defined}: it belongs in lightning_4d/{package}/"
        assert any(target.startswith(f"lightning_4d.{package}") for target in layout.imports(path, layout.modules()))


@pytest.mark.parametrize("package", [*layout.DIMENSIONS, "checkpoint", "planner", "faults", "callbacks", "composition",
                                     "numerics", "memory", "observability", "modules", "_compat"])
def test_each_package_says_what_it_owns_and_lists_its_names(package):
    tree = ast.parse((layout.PACKAGE / package / "__init__.py").read_text())
    assert ast.get_docstring(tree), f"lightning_4d/{package}/__init__.py has no docstring"
    assert any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
               for node in tree.body), f"lightning_4d/{package}/__init__.py has no __all__"


def test_docs_package_picture_is_current():
    assert layout.OUTPUT.read_text() == layout.render(), "docs/packages.md is stale: run python docs/package_graph.py"
