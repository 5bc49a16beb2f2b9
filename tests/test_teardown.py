"""A finished run exits 0 on every rank, every time: 6 launches of a short fit at cp=2 (where an abort at exit,
"terminate called without an active exception", was seen about once in 110 launches), each rank ending through a
normal interpreter exit (the launcher's ranks are forked but leave through ``sys.exit``, as a process of their own
would). Each launch must exit 0 on both ranks after both printed that they finished: a rank that aborts while
tearing down fails the test with its output. ``python -m tests.teardown_stress 200`` runs hundreds, outside the
suite."""

from typing import Optional

from tests.parity import launch

LAUNCHES = 6


def finished_cleanly() -> Optional[str]:
    """One launch of tests/teardown_script.py; None when both ranks finished and exited 0, else what happened."""
    codes, output = launch(["-m", "tests.teardown_script"], 2, timeout=120)
    if codes != [0, 0] or output.count("finished rank") != 2:
        return f"exit codes {codes}:\n{output[-3000:]}"
    return None


def test_many_short_runs_exit_zero_on_every_rank():
    failures = [problem for problem in (finished_cleanly() for _ in range(LAUNCHES)) if problem is not None]
    assert not failures, failures[0]
