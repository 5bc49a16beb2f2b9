"""The docs cannot rot: their Python snippets run, their YAML parses into the strategy, and the API
reference is what docs/api_reference.py generates from the docstrings."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jsonargparse import ArgumentParser

from lightning_4d import FourDStrategy
from tests.parity import child_env, free_port

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


PYTHON_SNIPPETS = dict(_snippets("python"))
# What the snippet runner imports once before forking each snippet: what nearly every snippet imports itself.
PRELOAD = ["torch", "lightning.pytorch", "lightning_4d", "transformers", "peft"]
SNIPPET_TIMEOUT = 300
PROBE = """import importlib.util, json, lightning_4d
json.dump([lightning_4d.__file__, str(importlib.util.find_spec('examples')), str(importlib.util.find_spec('tests'))],
          open('probe.json', 'w'))
"""


@pytest.fixture(scope="module")
def snippet_runs(installed, tmp_path_factory) -> dict[str, dict]:
    """Every Python snippet (and the probe below) run once as a script in a user's environment, each in a
    folder of its own, by tests/snippet_runner.py: one process imports torch, Lightning and transformers once
    and forks a fresh process per snippet, instead of ~17 processes paying those imports (6-10 s of CPU each).
    Per snippet: its exit code, output and folder; each snippet is still its own test case below."""
    root = tmp_path_factory.mktemp("snippets")
    snippets = []
    for index, (where, code) in enumerate([("probe", PROBE), *PYTHON_SNIPPETS.items()]):
        folder = root / f"{index:02d}"
        folder.mkdir()
        (folder / "snippet.py").write_text(code)
        snippets.append({"where": where, "script": str(folder / "snippet.py"), "port": free_port()})
    out = root / "results.json"
    spec = root / "spec.json"
    spec.write_text(json.dumps({"snippets": snippets, "preload": PRELOAD, "timeout": SNIPPET_TIMEOUT,
                                "out": str(out)}))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "snippet_runner.py"), str(spec)], cwd=root,
                          env=_user_env(installed), capture_output=True, text=True,
                          timeout=SNIPPET_TIMEOUT * len(snippets) + 120)
    results = json.loads(out.read_text()) if out.exists() else {}
    for snippet in snippets:
        results.setdefault(snippet["where"], {"returncode": None, "output": f"the runner recorded nothing "
                                              f"(exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"})
        results[snippet["where"]]["folder"] = str(Path(snippet["script"]).parent)
    return results


def test_snippets_see_the_installed_package_only(installed, snippet_runs):
    probe = snippet_runs["probe"]
    assert probe["returncode"] == 0, probe["output"]
    seen = json.loads((Path(probe["folder"]) / "probe.json").read_text())
    assert seen == [str(installed / "lightning_4d" / "__init__.py"), "None", "None"]


@pytest.mark.parametrize("where", PYTHON_SNIPPETS)
def test_python_snippet_runs(where, snippet_runs):
    run = snippet_runs[where]
    assert run["returncode"] == 0, f"{where}:\n{run['output'][-6000:]}"


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
