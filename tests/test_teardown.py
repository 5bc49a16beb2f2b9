"""A finished run exits 0 on every rank, every time: 6 launches of tests/teardown_script.py (Lightning's own
launcher, a short fit at dp=2, a last collective just before exit). Without the release of gloo's threads at
exit it aborted on some rank in 12 of 40 launches on torch 2.15.0 ("terminate called without an active
exception"), so 6 launches catch it 9 times in 10; with it, in none of 60. Each launch must exit 0, with both
ranks saying they finished and no rank aborting (the second rank writes to the same stderr, which is read to
its end). ``python -m tests.teardown_stress 200`` runs hundreds, outside the suite."""

import subprocess
import sys
from typing import Optional

from tests.parity import ROOT, script_env

LAUNCHES = 6


def finished_cleanly() -> Optional[str]:
    """One launch of tests/teardown_script.py; None when both ranks finished and none aborted, else what happened."""
    done = subprocess.run([sys.executable, "-m", "tests.teardown_script"], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    finished = all(f"finished rank {rank} of 2" in output for rank in (0, 1))
    if done.returncode != 0 or not finished or "terminate called" in output:
        return f"exit code {done.returncode}:\n{output[-3000:]}"
    return None


def test_many_short_runs_exit_zero_on_every_rank():
    failures = [problem for problem in (finished_cleanly() for _ in range(LAUNCHES)) if problem is not None]
    assert not failures, failures[0]
