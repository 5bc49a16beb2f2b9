"""``FourDStrategy(start_method="fork")``: the other ranks of a node are forked from the launching process.
Its parity with one process is tested through demo.yaml (tests/test_demo_configs.py, which forks) and its
quiet output through the 16-process demo (tests/test_quiet_output.py); here: what it refuses, and that a rank
that fails ends every rank, named."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_4d import FourDStrategy
from lightning_4d.launcher import ForkLauncher
from tests.parity import script_env

ROOT = Path(__file__).resolve().parent.parent


def test_an_unknown_start_method_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"start_method='spawn' is not supported: use 'popen' .* or 'fork'"):
        FourDStrategy(start_method="spawn")


def test_fork_refuses_a_gpu_run_before_starting_anything():
    class OnCuda:
        root_device = torch.device("cuda", 0)

    with pytest.raises(ValueError, match=r"start_method='fork' starts CPU processes.*Use start_method='popen'"):
        ForkLauncher(OnCuda()).launch(lambda: pytest.fail("the function must not run"))


def _run(mode: str) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tests.launcher_script", mode], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def test_forked_ranks_train_and_rank_zero_returns_to_the_caller():
    code, out, _ = _run("ok")
    assert code == 0, out[-4000:]
    assert "finished on global rank 0 at step 3" in out, out[-4000:]
    assert "finished on global rank 1" not in out  # a forked rank ends with its process, not in the caller


def test_a_forked_rank_that_fails_ends_every_rank_naming_it():
    code, out, took = _run("fail")
    assert code != 0, out[-4000:]
    assert "boom on rank 1 at step 2" in out, out[-4000:]
    assert "rank 1" in out and "finished on global rank" not in out, out[-4000:]
    assert took < 120, took
