"""The command lines behave alike: a bad argument or a known failure exits 2 with one line on stderr
(``prog: error: ...``, no traceback), ``--module`` is ``package.module:Class`` for plan and export, and
``--help`` of each (plan, export, verify_checkpoint) answers without importing torch or Lightning."""

import subprocess
import sys

import pytest

from tests.parity import script_env

PLAN = [sys.executable, "-m", "lightning_4d.plan"]
EXPORT = [sys.executable, "-m", "lightning_4d.export"]
VERIFY = [sys.executable, "-m", "lightning_4d.verify_checkpoint"]
PLAN_SIZES = ["--devices", "2", "--seq", "64", "--global-batch", "4"]


def _run(command, tmp_path, *extra):
    return subprocess.run([*command, *extra], cwd=tmp_path, env=script_env(), capture_output=True, text=True,
                          timeout=180)


def _assert_one_line_error(done, prog: str, *fragments: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr, done.stderr
    assert last.startswith(f"python -m {prog}: error: "), done.stderr
    for fragment in fragments:
        assert fragment in last, (fragment, last)


@pytest.mark.parametrize("command", [PLAN, EXPORT, VERIFY], ids=["plan", "export", "verify_checkpoint"])
def test_help_imports_neither_torch_nor_lightning(command, tmp_path):
    done = subprocess.run([sys.executable, "-X", "importtime", *command[1:], "--help"], cwd=tmp_path,
                          env=script_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m lightning_4d." in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import")}
    heavy = sorted(name for name in imported if name.split(".")[0] in ("torch", "lightning", "numpy"))
    assert "lightning_4d" in imported and not heavy, heavy


@pytest.mark.parametrize("command", [PLAN, EXPORT, VERIFY], ids=["plan", "export", "verify_checkpoint"])
def test_argparse_errors_exit_2(command, tmp_path):
    _assert_one_line_error(_run(command, tmp_path), command[2], "the following arguments are required")


@pytest.mark.parametrize(("spec", "fragment"), [
    ("no_such_package.model:GPT", "cannot import 'no_such_package.model'"),
    ("lightning_4d.demos.gpt:NoSuchClass", "has no class 'NoSuchClass'"),
    ("GPT", "write package.module:Class"),
])
def test_export_names_a_bad_module_in_one_line(spec, fragment, tmp_path):
    done = _run(EXPORT, tmp_path, str(tmp_path), str(tmp_path / "hf"), "--hf", "--module", spec)
    _assert_one_line_error(done, "lightning_4d.export", f"--module {spec!r}", fragment)


def test_export_known_failures_exit_2(tmp_path):
    missing = tmp_path / "no_checkpoint"
    _assert_one_line_error(_run(EXPORT, tmp_path, str(missing), "out.ckpt"), "lightning_4d.export",
                           f"{missing} is not a lightning-4d checkpoint directory")
    _assert_one_line_error(_run(EXPORT, tmp_path, str(missing), "hf", "--hf"), "lightning_4d.export",
                           "--hf needs --module package.module:Class")
    _assert_one_line_error(_run(EXPORT, tmp_path, str(missing), "hf", "--hf", "--module",
                                "lightning_4d.demos.gpt:GPT"), "lightning_4d.export",
                           f"{missing} is not a lightning-4d checkpoint directory")


def test_plan_known_failures_exit_2(tmp_path):
    _assert_one_line_error(_run(PLAN, tmp_path, *PLAN_SIZES, "--module", "no_such_package.model:GPT"),
                           "lightning_4d.plan", "--module 'no_such_package.model:GPT' is not importable")
    _assert_one_line_error(_run(PLAN, tmp_path, *PLAN_SIZES, "--module", "lightning_4d.demos.gpt:GPT",
                                "--init-args", '{"n_embd": 30, "n_head": 4}'),
                           "lightning_4d.plan", "--module lightning_4d.demos.gpt:GPT", "ValueError: n_embd (30) must be"
                           " divisible by n_head (4)")
    _assert_one_line_error(_run(PLAN, tmp_path, *PLAN_SIZES, "--init-args", "{not json"), "lightning_4d.plan",
                           "--init-args")
    _assert_one_line_error(_run(PLAN, tmp_path, *PLAN_SIZES, "--hidden", "64"), "lightning_4d.plan",
                           "missing --layers --heads")
