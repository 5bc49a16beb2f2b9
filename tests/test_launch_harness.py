"""The launch harness every multi-process test stands on (tests/parity.py): forked launches share one fork
server per session (tests/fork_ranks.py), so a launch that ends badly must leave the server's answers in step
for the next launch, and a hang must end at its timeout with every rank killed."""

import lightning.pytorch as pl
import pytest

from tests.parity import Case, _ForkServer, assert_parity, launch, rank_tails, reference, run_layout

# Each rank sleeps as long as the file beside the script says (the environment stays the session's, so the
# launches go through the fork server) and exits with 3 + its rank.
RANK = """import os, sys, time
time.sleep(float(open(os.path.join(os.path.dirname(__file__), "sleep_s")).read()))
sys.exit(3 + int(os.environ["RANK"]))
"""


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def _sleep(script, seconds: float) -> None:
    (script.parent / "sleep_s").write_text(str(seconds))


def test_a_failed_reference_ends_its_launch_and_the_next_launch_reads_its_own_ranks(script):
    def failing():
        raise RuntimeError("the reference failed")

    _sleep(script, 1)
    with pytest.raises(RuntimeError, match="the reference failed"):
        launch([str(script)], 2, timeout=60, while_running=failing)
    _sleep(script, 0)
    codes, _ = launch([str(script)], 2, timeout=60)
    assert codes == [3, 4]


def test_a_hang_ends_at_its_timeout_and_the_next_launch_reads_its_own_ranks(script):
    _sleep(script, 120)
    codes, output = launch([str(script)], 2, timeout=3)
    assert codes == [-9, -9] and output.startswith("TIMEOUT after 3 s"), (codes, output[:200])
    _sleep(script, 0)
    codes, _ = launch([str(script)], 2, timeout=60)
    assert codes == [3, 4]


def test_what_one_test_leaves_in_the_environment_does_not_cost_the_next_launches_the_fork_server(script, monkeypatch):
    """pytest renames the running test in the environment at every phase, and an in-process run's
    ``seed_everything`` leaves its seed there: neither may make a launch start a process of its own (importing
    torch and Lightning again) instead of being forked by the session's server."""
    _sleep(script, 0)
    assert launch([str(script)], 2, timeout=60)[0] == [3, 4]  # the server runs from here on
    alone = _ForkServer.started_alone
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_other.py::test_other (call)")
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    pl.seed_everything(1234, workers=True, verbose=False)  # what a reference run does
    assert launch([str(script)], 2, timeout=60)[0] == [3, 4]
    assert _ForkServer.started_alone == alone


def test_a_rank_killed_by_a_signal_leaves_its_stack_and_its_log_is_shown(tmp_path):
    """A rank that dies by SIGSEGV (a crash inside torch) prints where it was (faulthandler, enabled in every
    rank), and the failure message shows every rank's log end: the crashed rank's too, not only the last one's."""
    path = tmp_path / "crash.py"
    path.write_text("import os, signal, sys, time\n"
                    "def crash_inside_a_step():\n"
                    "    os.kill(os.getpid(), signal.SIGSEGV)\n"
                    "if os.environ['RANK'] == '0':\n"
                    "    crash_inside_a_step()\n"
                    "print('rank 1 ' + 'x' * 8000, flush=True)\n"
                    "sys.exit(1)\n")
    codes, output = launch([str(path)], 2, timeout=60)
    assert codes == [-11, 1], (codes, output[-2000:])
    shown = rank_tails(output)
    assert "Fatal Python error: Segmentation fault" in shown and "crash_inside_a_step" in shown, shown[:3000]
    assert "Fatal Python error" not in output[-6000:], "the crashed rank's log is not at the output's end"


def test_a_replica_that_drifts_fails_its_case():
    """Every rank's record is compared with rank 0's (tests/parity_worker.py saves them all): rank 1 changes one
    weight before its second step and trains on; its weights then differ from rank 0's (their gradients are
    all-reduced, but the step starts from different values)."""
    drifting = Case("drifting", module="tests.models:Classifier", data="tests.models:classification_data",
                    strategy={"dp": 2}, max_steps=3, callbacks=["tests.probes:PerturbWeightOnRank"])
    record = run_layout([drifting], 2, timeout=120).results["drifting"]
    assert "drifting: rank 1 against rank 0: weight" in record["disagreement"], record["disagreement"]
    with pytest.raises(AssertionError, match="drifting: rank 1 against rank 0: weight"):
        assert_parity(drifting, reference(drifting), record)
