"""The docs cannot rot: their Python snippets run, their YAML parses into the strategy, and the API
reference is what docs/api_reference.py generates from the docstrings."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jsonargparse import ArgumentParser

from lightning_4d import FourDStrategy
from tests.parity import child_env

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"```(python|yaml)\n(.*?)```", re.S)


def _snippets(language: str) -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for index, (lang, body) in enumerate(FENCE.findall(path.read_text())):
            if lang == language:
                found.append((f"{path.name}#{index}", body))
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """What ``pip install .`` puts on a user's machine, from a copy of this checkout, in a folder of its own:
    the package alone (no ``examples/``, no ``tests/``, no repository root)."""
    source, target = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "lightning_4d", source / "lightning_4d",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-compile", "--target", str(target), str(source)], check=True, capture_output=True,
                   timeout=300)
    return target


def _user_env(site: Path) -> dict[str, str]:
    """A user's environment: the installed package on the path, nothing of this checkout."""
    return child_env(PYTHONPATH=str(site))


def test_snippets_see_the_installed_package_only(installed, tmp_path):
    probe = ("import importlib.util, lightning_4d; print(lightning_4d.__file__);"
             " print(importlib.util.find_spec('examples'), importlib.util.find_spec('tests'))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_user_env(installed),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(installed / "lightning_4d" / "__init__.py"), "None None"]


@pytest.mark.parametrize(("where", "code"), _snippets("python"), ids=lambda v: v if "#" in str(v) else "")
def test_python_snippet_runs(where, code, installed, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_user_env(installed),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def _strategy_configs() -> list[tuple[str, dict]]:
    configs = []
    for where, body in _snippets("yaml"):
        config = yaml.safe_load(body)
        strategy = (config.get("trainer") or {}).get("strategy") if isinstance(config, dict) else None
        if isinstance(strategy, dict):
            configs.append((where, strategy))
    return configs


@pytest.mark.parametrize(("where", "strategy"), _strategy_configs(), ids=lambda v: v if "#" in str(v) else "")
def test_yaml_snippet_builds_the_strategy(where, strategy):
    assert strategy["class_path"] == "lightning_4d.FourDStrategy", where
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(FourDStrategy, "strategy")
    config = parser.parse_object({"strategy": strategy.get("init_args", {})})
    assert isinstance(parser.instantiate_classes(config).strategy, FourDStrategy), where


def test_api_reference_is_current_and_complete():
    sys.path.insert(0, str(ROOT / "docs"))
    import api_reference

    undocumented = [f"{module}.{name}" for module in api_reference.public_modules()
                    for name, value in api_reference.public_names(__import__(module, fromlist=["_"]))
                    if not (value.__doc__ or "").strip()]
    assert not undocumented, f"public names without a docstring: {undocumented}"
    assert (ROOT / "docs" / "api.md").read_text() == api_reference.render(), \
        "docs/api.md is stale: run python docs/api_reference.py"
