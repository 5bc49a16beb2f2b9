"""The heartbeat thread alone, without a Trainer or processes: two ranks' heartbeats share one TCPStore in this
process, and ``exit`` records what would end the process."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_4d.faults.liveness import EXIT_RANK_LOST, EXIT_STALLED, Heartbeat
from tests.parity import free_port, spawn


def _pair(**options):
    port = free_port()
    stores = [dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False) for rank in (0, 1)]
    exits = {0: [], 1: []}
    beats = [Heartbeat(stores[rank], rank, 2, exit=exits[rank].append, **options) for rank in (0, 1)]
    return beats, exits


def _wait(condition, limit):
    deadline = time.monotonic() + limit
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return time.monotonic() - (deadline - limit)


def test_a_rank_whose_heartbeat_stops_is_lost_within_the_bound(capfd):
    beats, exits = _pair(interval=0.2, lost_after=1.0, stall_after=None)
    for beat in beats:
        beat.start()
    time.sleep(0.5)
    beats[1]._stop.set()  # dies: no more beats, and no "left" record
    took = _wait(lambda: exits[0], 5)
    assert exits[0] == [EXIT_RANK_LOST] and not exits[1], exits
    # Its last beat was at most one interval before the stop, and the judge looks once per interval: lost
    # no sooner than lost_after - interval, no later than lost_after + 2 intervals. The upper bound gets 1 s of
    # slack for thread scheduling on a loaded 2-core CI machine (a run measured 1.75 s against 1.7 s).
    assert 1.0 - 0.2 - 0.1 <= took <= 1.0 + 2 * 0.2 + 1.0, took
    assert "rank 1 lost: no heartbeat for 1 s" in capfd.readouterr().err


def test_a_rank_that_leaves_on_purpose_is_not_lost():
    beats, exits = _pair(interval=0.2, lost_after=1.0, stall_after=None)
    for beat in beats:
        beat.start()
    time.sleep(0.5)
    beats[1].stop("finished")
    time.sleep(1.8)
    beats[0].stop()
    assert exits == {0: [], 1: []}


def test_a_rank_waiting_in_the_store_still_beats():
    """A rank's main thread may wait in its store for a long time: a pipeline stage reads the last stage's step
    results there (``pipeline/results.py``), gloo's group set-up reads its peers' addresses. torch's store client
    answers one request at a time, so a heartbeat sharing the main thread's client waited behind that ``get``:
    a first stage whose last stage took longer than ``lost_after`` over a step was called lost (CI, test_zoo).
    The heartbeat has a connection of its own; rank 0's main thread here waits three times ``lost_after``."""
    port = free_port()
    stores = [dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False,
                            timeout=timedelta(seconds=3)) for rank in (0, 1)]
    exits = {0: [], 1: []}
    beats = [Heartbeat(stores[rank], rank, 2, exit=exits[rank].append, interval=0.2, lost_after=1.0,
                       stall_after=None).start() for rank in (0, 1)]
    with pytest.raises(dist.DistStoreError):
        stores[0].get("written_by_nobody")  # rank 0's main thread, 3 s
    assert exits == {0: [], 1: []}, exits
    for beat in beats:
        beat.stop()


def test_the_rank_behind_is_named_stalled_and_the_others_exit_too(capfd):
    beats, exits = _pair(interval=0.2, lost_after=1.0, stall_after=1.5)
    for beat in beats:
        beat.start()
    beats[0].mark("training_step", 3)
    beats[0].mark("backward", 3)  # rank 0 waits in backward's all-reduce
    beats[1].mark("training_step", 3)  # rank 1 never gets there
    _wait(lambda: exits[0] and exits[1], 6)
    assert exits == {0: [EXIT_RANK_LOST], 1: [EXIT_STALLED]}, exits
    err = capfd.readouterr().err
    assert "rank 1 stalled: no progress for" in err and "rank 1 at step 3 in training_step" in err, err
    assert "this rank is stalled; where its threads are" in err


def test_rank_0_keeps_the_store_up_until_a_peer_that_still_beats_has_judged_too(capfd):
    """Rank 0 judges first (here: it is the rank behind, stalled) while rank 1's thread has not judged yet (a
    loaded machine delayed it; here it never judges a stall). Rank 0 hosts the store: it exits only once rank 1
    stopped beating (rank 1 judges rank 0 lost after its ``lost_after``), not after a fixed three beats, which
    left rank 1's collective broken before its judgement (it exited 1 instead of 76 in a CI run). A collective
    failing in rank 0's main thread after the judgement is its consequence: the thread reports, not main."""
    port = free_port()
    stores = [dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False) for rank in (0, 1)]
    exits = {0: [], 1: []}
    options = [dict(interval=0.2, lost_after=1.0, stall_after=1.0),
               dict(interval=0.2, lost_after=1.0, stall_after=None)]
    beats = [Heartbeat(stores[rank], rank, 2, exit=lambda code, rank=rank: exits[rank].append((code, time.monotonic())),
                       **options[rank]) for rank in (0, 1)]
    for beat in beats:
        beat.start()
    beats[1].mark("training_step", 3)
    beats[1].mark("backward", 3)  # rank 1 waits in backward's all-reduce for rank 0
    beats[0].mark("training_step", 3)  # rank 0 never gets there
    _wait(lambda: exits[0] and exits[1], 10)
    assert [code for code, _ in exits[0]] == [EXIT_STALLED] and [code for code, _ in exits[1]] == [EXIT_RANK_LOST]
    assert exits[0][0][1] > exits[1][0][1], "rank 0 took the store away while rank 1 still beat"
    assert not beats[0].claim_report("main")
    assert "rank 0 (it hosts" not in capfd.readouterr().err  # rank 1 saw rank 0's beat stop, not its store go


def test_ranks_at_the_same_point_are_not_judged_stalled():
    beats, exits = _pair(interval=0.2, lost_after=1.0, stall_after=1.0)
    for beat in beats:
        beat.start()
        beat.mark("saving a checkpoint", 5)  # everyone busy in the same place (a long save)
    time.sleep(2.5)
    for beat in beats:
        beat.stop()
    assert exits == {0: [], 1: []}


def test_a_rank_blocked_by_a_failure_names_it_and_leaves_as_failed_not_lost(capfd):
    """Rank 1's own code raised and it claimed the first failure; rank 0 waits in a collective that will not
    finish. Its heartbeat names rank 1's failure, marks itself left after a failure (a third rank whose
    collective breaks when rank 0 ends must not call it lost), and takes the report from the main thread."""
    import json
    import threading

    from lightning_4d.faults.liveness import FIRST_FAILURE_KEY

    beats, exits = _pair(interval=0.2, lost_after=1.0, stall_after=None)
    for beat in beats:
        beat.start()
    beats[0].mark("backward", 3)
    store = beats[1].store
    assert store.add(FIRST_FAILURE_KEY + "/count", 1) == 1  # rank 1 claims the slot, then formats its traceback
    threading.Timer(0.5, lambda: store.set(FIRST_FAILURE_KEY, "rank 1 failed first:\nValueError: bad batch\n")).start()
    beats[1].stop("failed (ValueError)")
    _wait(lambda: exits[0], 6)
    assert exits == {0: [EXIT_RANK_LOST], 1: []}, exits
    err = capfd.readouterr().err
    assert "rank 0 stopped because rank 1 failed first:\nValueError: bad batch" in err, err
    assert json.loads(store.get("lightning_4d/heartbeat/0"))["left"] == "failed (blocked by rank 1)"
    assert not beats[0].claim_report("main")  # the main thread's own report, if its collective fails now, yields


def test_a_failed_collective_is_recognised_through_the_exceptions_it_was_raised_from():
    from lightning_4d.faults.report import _is_communication_error

    try:
        try:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:25763")
        except RuntimeError as error:
            raise RuntimeError("[Stage 1] failed to run forward:\nargs: ...") from error
    except RuntimeError as wrapped:
        assert _is_communication_error(wrapped)
    assert not _is_communication_error(ValueError("bad batch"))


def test_rank_0_keeps_the_store_until_every_rank_reported_not_until_a_count():
    """A count can reach the world size while one rank has not read the failure yet (a rank counted by its
    heartbeat and by its main thread): rank 0 waits for each rank's own key."""
    from lightning_4d.faults.liveness import FIRST_FAILURE_KEY
    from lightning_4d.faults.report import _waiting_for

    store = dist.HashStore()
    store.add(FIRST_FAILURE_KEY + "/count", 3)
    store.set(FIRST_FAILURE_KEY + "/reported/0", "1")
    assert _waiting_for(store, 2, None)
    store.set(FIRST_FAILURE_KEY + "/reported/1", "1")
    assert not _waiting_for(store, 2, None)


def test_bad_settings_fail_before_anything_starts():
    with pytest.raises(ValueError, match="lost_after=0.5 must be at least twice heartbeat_interval=1"):
        Heartbeat(None, 0, 2, interval=1, lost_after=0.5)
    with pytest.raises(ValueError, match="stall_after=1 must be None"):
        Heartbeat(None, 0, 2, interval=0.2, lost_after=2, stall_after=1)


def _recorder_worker(rank, world_size, out_dir, port):
    """The recorder in a fresh one-rank gloo group (the test process may hold a default group already)."""
    import json
    import os
    import traceback

    import torch

    from lightning_4d.faults import recorder
    from lightning_4d.faults.recorder import RECORDER

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        recorder.install()
        RECORDER.name_groups({"dp_cp": dist.group.WORLD})
        RECORDER.where("backward", 7)
        dist.all_reduce(torch.ones(2, 3))
        dist.broadcast(torch.ones(4), src=0)
        first, second = RECORDER.last(2)
        assert (first["op"], first["group"], first["shape"], first["step"], first["doing"], first["state"]) == (
            "all_reduce", "world/dp_cp[0]", "(2, 3)", 7, "backward", "done"), first
        assert (second["op"], second["seq"]) == ("broadcast", first["seq"] + 1), second
        recorder.install()  # idempotent: one record per call, not two
        dist.barrier()
        assert RECORDER.last(1)[0]["seq"] == second["seq"] + 1, RECORDER.last(1)
        beat = Heartbeat(dist.distributed_c10d._get_default_store(), 0, 1, exit=lambda code: None)
        line = f"barrier #{second['seq'] + 1} on world/dp_cp[0] done (issued at step 7 in backward)"
        assert line in beat.table(), beat.table()
        outcome = {"error": None}
    except AssertionError:
        outcome = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump(outcome, out)


def test_the_recorder_names_each_collective_its_group_and_sequence():
    """In a one-rank gloo group: the ring holds op, group name, per-group sequence number, shape, where, and
    whether the call completed; the heartbeat's table shows the newest one."""
    (outcome,) = spawn(_recorder_worker, 1, 120, free_port())
    assert outcome["error"] is None, outcome["error"]


def test_timeouts_are_checked_when_the_strategy_is_made():
    from datetime import timedelta

    from lightning_4d import FourDStrategy

    with pytest.raises(ValueError, match="timeout=-1 must be a positive timedelta"):
        FourDStrategy(timeout=-1)
    strategy = FourDStrategy(timeout=30, init_timeout=timedelta(minutes=20))
    assert strategy.collective_timeouts.train == timedelta(seconds=30)
    assert strategy.collective_timeouts.init == timedelta(minutes=20)


def test_the_comparison_of_last_collectives_says_what_they_show():
    from lightning_4d.faults.recorder import compare

    waiting = {"op": "all_reduce", "group": "dp_cp[0,1]", "seq": 12, "shape": "(3,)", "step": 2,
               "doing": "training_step", "state": "waiting"}
    other = dict(waiting, op="broadcast", group="world[0,1]", seq=11)
    done = dict(waiting, seq=11, state="done")
    assert "The ranks' last collectives differ (rank 0: all_reduce #12 on dp_cp[0,1] (3,) waiting" in compare(
        {0: waiting, 1: other})
    assert "rank 1: broadcast #11 on world[0,1]" in compare({0: waiting, 1: other})
    assert "Ranks [0] wait in all_reduce #12 on dp_cp[0,1] (3,) waiting (issued at step 2 in training_step); ranks [1]" \
           " are in no collective" in compare({0: waiting, 1: done})
    assert compare({0: waiting, 1: dict(waiting)}) == " Every rank waits in the same call: a peer is slow or stuck inside it."
    assert compare({0: done, 1: None}) == ""


_EXIT_SCRIPT = """
import atexit, json, sys
import torch.distributed as dist
from lightning_4d.faults.report import destroy_process_groups_at_exit, report_failure
out, port, raised = sys.argv[1], sys.argv[2], sys.argv[3] == "raised"
# Registered first, so it runs last (atexit is last in, first out): what the strategy's handler left behind.
atexit.register(lambda: open(out, "w").write(json.dumps(dist.is_initialized())))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
destroy_process_groups_at_exit()
destroy_process_groups_at_exit()  # once per process, however many Trainers set up
dist.all_reduce(__import__("torch").ones(3))
if raised:
    report_failure(0, RuntimeError("the step failed"), 1, linger=0)
"""


@pytest.mark.parametrize("outcome", ["finished", "raised"])
def test_process_groups_are_destroyed_at_exit_unless_the_run_raised(tmp_path, outcome):
    """Gloo's threads must not outlive a successful run into interpreter finalization (SIGABRT there); after a
    failure the groups are left alone, since destroying them waits for collectives no peer may finish."""
    import json
    import subprocess
    import sys

    from tests.parity import ROOT, child_env

    out = tmp_path / "initialized.json"
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(out), str(free_port()), outcome], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text()) is (outcome == "raised"), done.stderr[-3000:]
