"""A run that comes back by itself under ``torchrun --max-restarts`` (docs/checkpoints.md, "Automatic restarts").

The example CLI (examples/train.py) with tests/restarts.yaml: dp=2, the demo GPT made tiny, 24 steps, a
``ModelCheckpoint`` every 4 steps with ``save_last``, and ``ckpt_path: last``, started by
``torchrun --standalone --nproc-per-node 2 --max-restarts 2``. tests/restart_probe.py (added to the callbacks on
the command line) makes rank 1 SIGKILL itself in the attempts it is told to, writes timestamped events and saves
the final weights. Every run is the same command; only the probe's environment differs. Two jobs: one
uninterrupted, and one where rank 1 dies twice (mid-training in the first attempt, while writing its shard of a
checkpoint in the second), so the third attempt comes back from a restart after a restart.

Torch's defaults are kept: the agent keeps one store for every attempt, and the package makes each attempt's
process group under the attempt's own name (``launcher.attempt_store``; without it, 5 of 6 restarts here failed or
hung in the set-up on the killed attempt's connection keys). That, and the package's own keys in a store that
outlives an attempt, are also tested without torchrun (the last tests), where the stale keys can be made on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.parity import ROOT, child_env, free_port, spawn

COMMAND = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
           "examples/train.py", "fit", "--config", "tests/restarts.yaml"]
LIMIT = 420  # seconds for one torchrun job; a hang is killed and fails the test
NO_LAST = 'ckpt_path="last") is set, but there is no last checkpoint available. No checkpoint will be loaded.'


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: torchrun starts each worker in a session of its own, so killing
    the agent's process group would miss them)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _stop(agent: subprocess.Popen) -> None:
    """End a torchrun job that ran past its limit: every worker, then the agent."""
    for pid in [*reversed(_descendants(agent.pid)), agent.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _torchrun(out: Path, kill: str | None = None) -> dict:
    """One job of the same command; ``kill`` tells the probe when rank 1 dies, per attempt (tests/restart_probe.py)."""
    out.mkdir()
    env = child_env(PYTHONUNBUFFERED="1", RESTART_PROBE_OUT=str(out))
    if kill:
        env["RESTART_PROBE_KILL"] = kill
    start = time.time()
    with open(out / "output.txt", "w") as sink:
        agent = subprocess.Popen([sys.executable, *COMMAND, "--trainer.default_root_dir", str(out / "root"),
                                  "--trainer.callbacks+=tests.restart_probe.RestartProbe"], cwd=ROOT, env=env,
                                 stdout=sink, stderr=subprocess.STDOUT)
        try:
            code = agent.wait(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            _stop(agent)
            code = None
    output = (out / "output.txt").read_text()
    assert code is not None, f"torchrun still running after {LIMIT} s (hang?); killed:\n{output[-6000:]}"
    events = [json.loads(line) for rank in (0, 1) if (out / f"events-rank{rank}.jsonl").exists()
              for line in (out / f"events-rank{rank}.jsonl").read_text().splitlines()]
    return {"code": code, "output": output, "events": events, "took": time.time() - start, "out": out}


def _of(run: dict, event: str, attempt: int | None = None) -> list[dict]:
    return [e for e in run["events"] if e["event"] == event and (attempt is None or e["attempt"] == attempt)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same command with nothing killed, and no checkpoint yet: ``ckpt_path: last`` starts fresh."""
    run = _torchrun(tmp_path_factory.mktemp("restarts") / "uninterrupted")
    assert run["code"] == 0, run["output"][-6000:]
    assert NO_LAST in run["output"], run["output"][-6000:]  # Lightning's warning, then a fresh start
    assert {e["attempt"] for e in run["events"]} == {0}
    assert [e["step"] for e in _of(run, "train_start")] == [0, 0]
    assert [e["step"] for e in _of(run, "train_end")] == [24, 24]
    print(f"uninterrupted run: {run['took']:.1f} s")
    return torch.load(run["out"] / "weights.pt")


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """Rank 1 dies at step 10 in the first attempt (the newest checkpoint is step 8) and, in the second, while it
    writes its shard of that attempt's second checkpoint (step 16; last.ckpt is at step 12)."""
    return _torchrun(tmp_path_factory.mktemp("restarts") / "killed", kill="step:10,save:2")


def _restarted(run: dict, attempt: int, resumed_at: int) -> None:
    """Exit 0 after two restarts (attempts 0, 1 and 2, both ranks in each restarted one); ``attempt`` resumed at
    ``resumed_at`` from last.ckpt."""
    assert run["code"] == 0, run["output"][-6000:]
    assert {e["attempt"] for e in run["events"]} == {0, 1, 2}, run["events"]
    assert len(_of(run, "kill", attempt - 1)) == 1 and "SIGKILLs itself" in run["output"]
    assert [e["step"] for e in _of(run, "train_start", attempt)] == [resumed_at] * 2, run["events"]
    assert [e["step"] for e in _of(run, "train_end")] == [24, 24], run["events"]  # only the last attempt ends
    assert "Restored all states from the checkpoint at" in run["output"] and "last.ckpt" in run["output"]


def _equal_weights(run: dict, reference: dict) -> None:
    weights = torch.load(run["out"] / "weights.pt")
    assert weights.keys() == reference.keys()
    different = [name for name in reference if not torch.equal(weights[name], reference[name])]
    assert not different, f"differ from the uninterrupted run: {different}"


def _recovery_time(run: dict, attempt: int) -> dict[str, float]:
    """Seconds from the kill in ``attempt - 1`` to: ``attempt``'s processes being up (imports done, config parsed),
    training starting (checkpoint restored), and the first step after the restart done (the last rank of each)."""
    kill = _of(run, "kill", attempt - 1)[0]["t"]
    return {name: max(e["t"] for e in _of(run, event, attempt)) - kill
            for name, event in (("processes up", "built"), ("training started", "train_start"),
                                ("first step done", "first_step"))}


def test_a_rank_killed_mid_training_restarts_and_ends_with_the_uninterrupted_weights(killed_twice, uninterrupted):
    """Rank 1 dies at step 10 (the newest checkpoint is step 8); torchrun restarts both ranks, which resume from
    last.ckpt at step 8 and, after the second restart below, end with the weights of the uninterrupted run, bit for
    bit."""
    run = killed_twice
    _restarted(run, attempt=1, resumed_at=8)
    assert _of(run, "kill", 0)[0]["where"] == "training step" and _of(run, "kill", 0)[0]["step"] == 10
    _equal_weights(run, uninterrupted)
    times = _recovery_time(run, 1)
    print(f"torchrun with two restarts: {run['took']:.1f} s in all; from the first kill: "
          + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items()))
    assert times["processes up"] < times["training started"] < times["first step done"]


def test_a_rank_killed_while_saving_leaves_a_partial_that_the_restarted_run_replaces(killed_twice, uninterrupted):
    """In the restarted attempt rank 1 dies while it writes its shard of step 16's checkpoint: last.ckpt stays at
    step 12 and ``epoch=0-step=16.ckpt.partial`` is left half-written. The run restarted again sees it, resumes at
    step 12, saves step 16 under the same name again (over the leftover), ends with the uninterrupted weights and
    leaves no ``.partial`` behind."""
    run = killed_twice
    _restarted(run, attempt=2, resumed_at=12)
    assert _of(run, "kill", 1)[0]["where"] == "writing epoch=0-step=16.ckpt.partial", run["events"]
    found = [e["checkpoints"] for e in _of(run, "train_start", 2) if e["rank"] == 0][0]
    assert "epoch=0-step=16.ckpt.partial" in found and "last.ckpt" in found, found
    assert 16 in [e["step"] for e in _of(run, "save", 2) if e["rank"] == 0], run["events"]
    left = [e["checkpoints"] for e in _of(run, "teardown", 2) if e["rank"] == 0][0]
    assert left == ["epoch=0-step=24.ckpt", "last.ckpt"], left
    _equal_weights(run, uninterrupted)
    times = _recovery_time(run, 2)
    print("torchrun, killed while saving: from the kill: "
          + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items()))
    assert times["processes up"] < times["training started"] < times["first step done"]


def _two_runs_on_one_store(rank: int, world_size: int, out_dir: str, port: int) -> None:
    """Two runs of the package on one process group's store, as torchrun's agent keeps its store for every
    attempt: the first leaves what a killed attempt leaves (rank 0's heartbeat record "left: failed", the
    first-failure slot taken, a pipeline result of step 1); then the second begins (a new run name, a barrier)."""
    import os

    import torch.distributed as dist

    from lightning_4d.parallel_dims import begin_run_keys, run_scoped_store
    from lightning_4d._compat import default_store
    from lightning_4d.faults import report
    from lightning_4d.faults.liveness import FIRST_FAILURE_KEY, Heartbeat
    from lightning_4d.pipeline import results

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    fast = dict(interval=0.2, lost_after=6.0, stall_after=None)

    # The attempt that was killed.
    begin_run_keys()
    dist.barrier()
    exchange = results.ResultExchange(dist.group.WORLD, 1, torch.device("cpu"))
    exchange.exchange({"loss": torch.ones(1)} if rank == 1 else None)  # as many bytes as step 1 of the next run
    if rank == 0:
        Heartbeat(default_store(), 0, world_size, **fast).start().stop("failed (RuntimeError)")
        slot = run_scoped_store(default_store())
        slot.set(FIRST_FAILURE_KEY, "rank 1 was lost in the attempt before\n")
        slot.add(FIRST_FAILURE_KEY + "/count", 1)
    dist.barrier()

    # The restarted attempt: new processes would count their pipeline exchanges from 1 again.
    begin_run_keys()
    dist.barrier()
    results.ResultExchange._created = 0
    exchange = results.ResultExchange(dist.group.WORLD, 1, torch.device("cpu"))
    if rank == 1:
        time.sleep(1.0)  # the last stage is behind: the other reads step 1's key before it is written
    received = exchange.exchange(torch.tensor(2.0) if rank == 1 else None)
    exits: list[int] = []
    if rank == 0:
        time.sleep(2.0)  # a slow start: rank 1's heartbeat runs (its main thread still) before rank 0's first beat
    beat = Heartbeat(default_store(), rank, world_size, exit=exits.append, **fast).start()
    time.sleep(2.0 if rank == 1 else 0.5)
    dist.barrier()
    if rank == 1:  # this attempt's own failure
        report.report_failure(1, ValueError("the restarted attempt's own failure"), world_size, linger=1.0)
    dist.barrier()
    first = run_scoped_store(default_store()).get(FIRST_FAILURE_KEY).decode()
    beat.stop()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"received": repr(received), "exits": exits, "first": first}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_a_restarted_run_does_not_read_the_killed_attempts_store_keys():
    """Without a run name of their own, the second run's rank 1 exits (76) on rank 0's old "left: failed" while
    rank 0 is only slow to start, its own failure is reported as the old one, and the pipeline's receiver takes
    step 1's structure from the first run."""
    outcome = spawn(_two_runs_on_one_store, 2, 120, free_port())
    seen = {rank: {"heartbeat exits": result["exits"], "pipeline result": result["received"],
                   "first failure": result["first"].strip().splitlines()[-1]} for rank, result in enumerate(outcome)}
    expected = {"heartbeat exits": [], "pipeline result": "tensor(2.)",
                "first failure": "ValueError: the restarted attempt's own failure"}
    assert seen == {0: expected, 1: expected}


def _one_attempt(rank: int, world_size: int, out_dir: str, port: int, attempt: int, scoped: bool) -> None:
    """One attempt's process-group set-up on the agent's store, as torchrun starts it (one node). Attempt 0 ends as
    a killed one does (no clean-up); in attempt 1 rank 1 begins 2 s after rank 0, so rank 0 looks for rank 1's
    connection keys before rank 1 has written them."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_4d.launcher import attempt_store

    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt),
                      TORCHELASTIC_MAX_RESTARTS="1", GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    timeout = timedelta(seconds=8)  # the set-up on stale keys fails by then
    store = attempt_store(rank, world_size, timeout) if scoped else \
        dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)  # torch's default
    if attempt == 1:  # rank 1 starts its set-up 2 s after rank 0 has begun its own, however loaded the machine
        signal_store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        begun = f"test/{'scoped' if scoped else 'bare'}/rank0_begun"
        if rank == 0:
            signal_store.set(begun, "1")
        else:
            signal_store.wait([begun])
            time.sleep(2.0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    total = torch.ones(1)
    dist.all_reduce(total)
    if rank == 0:
        store.set("written by rank 0", "1")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"sum": total.item()}, f)
    if attempt == 0:
        os._exit(0)  # as a killed attempt ends: its keys stay in the store
    dist.destroy_process_group()


def test_a_restarted_attempt_makes_its_process_group_under_a_name_of_its_own():
    """The agent's store outlives attempt 0 with its connection keys; attempt 1 makes its process group on the
    same store, rank 1 two seconds after rank 0, under the attempt's own name (``launcher.attempt_store``): both
    ranks connect, and what is written through that store lands under ``lightning_4d/attempt_<n>``. On the bare store, as torch's
    default does, rank 0 may read attempt 0's keys of rank 1: under torchrun 5 of 6 restarts failed or hung so
    (docs/checkpoints.md); in this simulation about half the runs do (gloo retries, and may find the new keys),
    too unsteady for the suite to assert."""
    port = free_port()
    agent = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for attempt in (0, 1):
        assert [r["sum"] for r in spawn(_one_attempt, 2, 60, port, attempt, True)] == [2.0, 2.0]
        assert agent.check([f"lightning_4d/attempt_{attempt}/written by rank 0"])  # the attempt's own name
    del agent


def test_attempt_store_keeps_torchs_set_up_off_torchrun_and_on_several_nodes(monkeypatch, capsys):
    from lightning_4d.launcher import attempt_store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # rank 0 hosts a new store per attempt
    assert attempt_store(0, 2, timedelta(seconds=5)) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # two agents: a replaced node would count attempts from 0
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert attempt_store(1, 4, timedelta(seconds=5)) is None
    assert capsys.readouterr().err == ""  # only rank 0 says it
    assert attempt_store(0, 4, timedelta(seconds=5)) is None
    assert "--max-restarts 3 on several nodes shares one rendezvous store" in capsys.readouterr().err
