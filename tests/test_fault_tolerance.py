"""Issue #16: preemption, lost and stalled ranks, uneven data, mismatched batch shapes, drifting buffers.

Every rank is its own process (``tests.parity.launch``: forked from one process that imported torch and Lightning
once, no launcher agent), under a hard timeout; ``grace`` is long so that the ranks must stop by themselves. The
``_under_torchrun`` tests run the same scenarios with every rank its own interpreter, started by torchrun's agent
as a scheduler starts them. Scenarios: tests/fault_worker.py.
The liveness settings of these runs: heartbeat every 0.5 s, lost after 3 s, stalled after 6 s.
"""

import json
import re
import time

import pytest
import torch

from lightning_4d import checkpoint
from lightning_4d.faults import EXIT_PREEMPTED, EXIT_RANK_LOST, EXIT_STALLED
from tests.parity import launch


def _run(scenario, out, *args, timeout=150, grace=60):
    start = time.time()
    codes, output = launch(["-m", "tests.fault_worker", scenario, str(out), *map(str, args)], 2, timeout=timeout,
                           grace=grace)
    assert "TIMEOUT" not in output[:200], output[-4000:]
    return codes, output, start


def _misbehaved_at(output):
    return float(re.search(r"rank 1 misbehaves \(\w+\) at t=([0-9.]+)", output).group(1))


def test_a_killed_rank_is_named_and_every_other_rank_exits(tmp_path):
    codes, output, _ = _run("kill", tmp_path)
    took = time.time() - _misbehaved_at(output)
    print(f"killed rank: all ranks exited {took:.1f} s after the kill")
    assert codes[1] == -9 and codes[0] > 0, (codes, output[-4000:])
    assert "rank 0 stopped because rank 1 was lost (no heartbeat" in output, output[-4000:]
    assert "failed first" not in output  # the survivor is not blamed
    assert took < 20, took


def test_a_stalled_rank_is_named_and_every_rank_exits(tmp_path):
    codes, output, _ = _run("stall", tmp_path)
    took = time.time() - _misbehaved_at(output)
    print(f"stalled rank: all ranks exited {took:.1f} s after the stall began")
    assert codes == [EXIT_RANK_LOST, EXIT_STALLED], (codes, output[-4000:])
    for rank in (0, 1):
        assert f"rank {rank} stops (exit {codes[rank]}): rank 1 stalled: no progress for" in output, output[-4000:]
    assert "this rank is stalled; where its threads are" in output and "in on_train_batch_start" in output
    assert took < 6 + 10, took


def _every_rank_raised(codes: list[int]) -> bool:
    """Every rank exited 1 by itself, each after printing the error (the tests count the message per rank); an
    abort signal (SIGABRT) or the launcher's kill (SIGKILL) fails."""
    return codes == [1] * len(codes)


def test_uneven_data_stops_every_rank_together_naming_the_counts(tmp_path):
    codes, output, _ = _run("uneven", tmp_path)
    assert _every_rank_raised(codes), (codes, output[-4000:])
    message = ("UnevenDataError: Uneven data across replicas in epoch 0: ranks [1] have no batch after batch 6"
               " while ranks [0] have more (batches per rank: rank 0: has more than 6 of 8, rank 1: ran out after"
               " 6 of 6)")
    assert output.count(message) >= 2, output[-4000:]
    assert "Connection" not in output


def test_different_batch_shapes_on_tensor_parallel_peers_are_named(tmp_path):
    codes, output, _ = _run("shapes", tmp_path)
    assert _every_rank_raised(codes), (codes, output[-4000:])
    message = ("received batches of different shapes at step 0: ranks [0]: [(4, 16), (4, 16)]; ranks [1]:"
               " [(4, 12), (4, 12)]")
    assert output.count(message) >= 2, output[-4000:]


def test_buffers_stay_in_sync_as_with_ddp(tmp_path):
    for kind in ("ddp", "fourd", "fourd-nobroadcast"):
        codes, output, _ = _run("bn", tmp_path, kind)
        assert codes == [0, 0], (kind, codes, output[-4000:])
    for rank in (0, 1):
        ddp = torch.load(tmp_path / f"bn-ddp-rank{rank}.pt")
        fourd = torch.load(tmp_path / f"bn-fourd-rank{rank}.pt")
        assert set(ddp) == set(fourd)
        for key, value in ddp.items():
            torch.testing.assert_close(fourd[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")
    # Without the broadcast rank 1 keeps only its own statistics: the test can tell the difference.
    drift = torch.load(tmp_path / "bn-fourd-nobroadcast-rank1.pt")
    assert (drift["net.1.running_mean"] - ddp["net.1.running_mean"]).abs().max() > 1e-3


def test_ten_preemptions_at_random_moments_resume_exactly(tmp_path):
    """10 SIGTERMs to both ranks (alternately mid-step and mid-save), 5 per launch: each launch ends with the
    preemption status, leaves no ``.partial``, and ``last.ckpt`` holds exactly the step the run stopped at;
    the run stitched from the 11 pieces equals an uninterrupted one (losses and weights, bit for bit)."""
    stopped = []
    for first in (0, 5):
        codes, output, start = _run("preempt", tmp_path, first, 5, 1600 + first, timeout=280, grace=60)
        print(f"preemption launch {first // 5}: {time.time() - start:.1f} s")
        assert codes == [EXIT_PREEMPTED] * 2, (codes, output[-6000:])
        assert output.count("[lightning-4d] preempted (SIGTERM on ranks") == 5, output[-4000:]
        assert not list((tmp_path / "ckpt").glob("*.partial")), list((tmp_path / "ckpt").iterdir())
        for cycle in range(first, first + 5):
            record = json.loads((tmp_path / f"cycle{cycle}.json").read_text())
            assert record["preempted_at"] is not None, cycle
            stopped.append(record)
        assert checkpoint.read_meta(tmp_path / "ckpt" / "last.ckpt")["global_step"] == stopped[-1]["preempted_at"]
    codes, output, _ = _run("preempt", tmp_path, -1, 0, 0, timeout=200)
    assert codes == [0, 0], (codes, output[-4000:])
    final = json.loads((tmp_path / "final.json").read_text())
    reference = json.loads((tmp_path / "reference.json").read_text())

    # No lost steps: each piece starts at the step the previous one stopped at (its last.ckpt).
    stitched, position = {}, 0
    for record in stopped + [final]:
        steps = sorted(int(step) for step in record["losses"])
        assert steps[0] == position + 1, (position, steps)
        stitched.update({int(step): loss for step, loss in record["losses"].items()})
        position = record["preempted_at"] if record["preempted_at"] is not None else steps[-1]
        if record is not final:
            assert steps[-1] == record["preempted_at"], (steps, record["preempted_at"])
    assert len(stopped) == 10
    assert stitched == {int(step): loss for step, loss in reference["losses"].items()}
    assert final["weights"] == reference["weights"]


def _torchrun(scenario, out, *args, timeout=150):
    """The same scenario under torchrun (its agent starts the ranks, and SIGTERMs the rest when one fails)."""
    import subprocess
    import sys

    from tests.parity import ROOT, child_env, free_port

    start = time.time()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), "-m", "tests.fault_worker", scenario,
                           str(out), *map(str, args)], cwd=ROOT, env=child_env(PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, start


@pytest.mark.parametrize("scenario", ["kill", "stall"])
def test_lost_and_stalled_ranks_under_torchrun(tmp_path, scenario):
    code, output, _ = _torchrun(scenario, tmp_path)
    took = time.time() - _misbehaved_at(output)
    print(f"torchrun, {scenario}: torchrun exited {took:.1f} s after rank 1 misbehaved")
    assert code != 0, output[-4000:]
    if scenario == "kill":
        assert "rank 0 stopped because rank 1 was lost (no heartbeat" in output, output[-4000:]
    else:
        assert "rank 0 stops (exit 76): rank 1 stalled" in output and "rank 1 stops (exit 77)" in output, output[-4000:]
    assert took < 20, took


def test_uneven_data_under_torchrun(tmp_path):
    code, output, _ = _torchrun("uneven", tmp_path)
    assert code != 0 and output.count("UnevenDataError: Uneven data across replicas in epoch 0: ranks [1]") >= 2, (
        output[-4000:])


def test_sigterm_to_torchrun_saves_the_current_step_and_exits_with_the_preemption_status(tmp_path):
    """The scheduler signals torchrun's agent, which sends SIGTERM to every worker: they finish the step, save
    last.ckpt complete and exit (with status 75; torchrun reports its own SignalException instead)."""
    import signal
    import subprocess
    import sys

    from tests.parity import ROOT, child_env, free_port

    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m",
                              "tests.fault_worker", "preempt-agent", str(tmp_path)], cwd=ROOT,
                             env=child_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lines = []
    try:
        for line in agent.stdout:
            lines.append(line)
            if line.startswith("at step 5"):
                agent.send_signal(signal.SIGTERM)
                break
        output = "".join(lines) + agent.communicate(timeout=120)[0]
    finally:
        agent.kill()
    stopped = re.search(r"preempted \(SIGTERM on ranks \[0, 1\]\): saved step (\d+) complete", output)
    assert stopped, output[-4000:]
    assert "Received 15 death signal, shutting down workers" in output  # the agent forwarded it
    assert checkpoint.read_meta(tmp_path / "ckpt" / "last.ckpt")["global_step"] == int(stopped.group(1))
    assert not list((tmp_path / "ckpt").glob("*.partial"))


_ONE_PROCESS = """
import os, signal, sys, time
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from lightning_4d import FourDStrategy
from tests.models import Classifier, classification_data

class SignalAtStep2(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2 and sys.argv[1] == "during":
            os.kill(os.getpid(), signal.SIGTERM)

t = pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(), max_steps=4, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=sys.argv[2], callbacks=[SignalAtStep2()])
t.fit(Classifier(), DataLoader(classification_data(), batch_size=8))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("still alive after SIGTERM")
"""


@pytest.mark.parametrize("when", ["during", "after"])
def test_one_process_preemption_and_sigterm_after_fit(tmp_path, when):
    """During fit, SIGTERM saves and exits 75; after fit it terminates the process as it did before (the
    handler is given back, also though Lightning restores the handlers it found when fit began)."""
    import subprocess
    import sys

    from tests.parity import ROOT, child_env

    done = subprocess.run([sys.executable, "-c", _ONE_PROCESS, when, str(tmp_path)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert "still alive" not in done.stdout
    if when == "during":
        assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
        assert checkpoint.read_meta(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 3
    else:
        assert done.returncode == -15, (done.returncode, done.stderr[-3000:])


def test_a_collective_issued_by_one_rank_only_is_found_without_debug(tmp_path):
    """The issue's silent hang: ``self.log(..., sync_dist=True)`` on rank 0 only. Rank 0 is the rank behind;
    it prints its stack, which shows the user's ``log`` line, and both ranks exit well before the 60 s
    collective timeout of this run."""
    codes, output, start = _run("mismatch", tmp_path)
    took = time.time() - start
    assert codes == [EXIT_STALLED, EXIT_RANK_LOST], (codes, output[-4000:])
    assert "rank 0 stalled: no progress for" in output
    assert re.search(r'fault_worker.py", line \d+ in training_step', output), output[-4000:]
    assert "in _sync_ddp" in output  # where it waits: the all-reduce of the log call
    print(f"one-sided collective: launch to all-exit {took:.1f} s")


CROSSED_TIMEOUT = 4.0


def test_different_collectives_end_every_rank_within_the_timeout_naming_both(tmp_path):
    """Without debug=True: rank 0 all-reduces over dp_cp while rank 1 broadcasts over the world. Both ranks are
    alive and at the same hook, so only the training timeout (4 s here) can end them; every rank exits within
    it plus the report's few seconds, and each prints the flight-recorder table with both ranks' last
    collectives, the mismatch spelled out."""
    codes, output, _ = _run("crossed", tmp_path, CROSSED_TIMEOUT, timeout=120, grace=60)
    crossed_at = min(float(t) for t in re.findall(r"rank \d crosses at t=([0-9.]+)", output))
    took = time.time() - crossed_at
    print(f"crossed collectives: every rank exited {took:.1f} s after the mismatch (timeout {CROSSED_TIMEOUT} s)")
    assert codes == [1, 1], (codes, output[-6000:])
    assert took < CROSSED_TIMEOUT + 12, took
    assert "Timed out waiting 4000ms" in output, output[-6000:]
    # With dp=2 on two ranks, dp_cp is the world's group: one group with all its names.
    rank0 = re.compile(r"all_reduce #\d+ on world/dp/dp_cp\[0,1\] \(3,\) waiting \(issued at step 2 in training_step\)")
    rank1 = re.compile(r"broadcast #\d+ on world/dp/dp_cp\[0,1\] \(3,\) waiting \(issued at step 2 in training_step\)")
    for rank in (0, 1):
        section = output.split(f"----- rank {rank} ")[1].split("----- rank ")[0]
        assert "The ranks' last collectives differ" in section, section[-4000:]
        table = section.split("last known state of every rank:")[1]
        rows = {int(line.split()[0]): line for line in table.splitlines()[2:4]}
        assert rank0.search(rows[0]) and rank1.search(rows[1]), table


def test_different_batch_shapes_under_torchrun(tmp_path):
    code, output, _ = _torchrun("shapes", tmp_path)
    assert code != 0 and output.count("received batches of different shapes at step 0") >= 2, output[-4000:]


def test_buffers_stay_in_sync_under_torchrun(tmp_path):
    for kind in ("ddp", "fourd"):
        code, output, _ = _torchrun("bn", tmp_path, kind)
        assert code == 0, (kind, output[-4000:])
    for rank in (0, 1):
        ddp = torch.load(tmp_path / f"bn-ddp-rank{rank}.pt")
        fourd = torch.load(tmp_path / f"bn-fourd-rank{rank}.pt")
        for key, value in ddp.items():
            torch.testing.assert_close(fourd[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")


def test_different_collectives_under_torchrun(tmp_path):
    """The same crossed collectives with torchrun's agent starting the ranks: every rank names both calls."""
    code, output, _ = _torchrun("crossed", tmp_path, CROSSED_TIMEOUT, timeout=120)
    crossed_at = min(float(t) for t in re.findall(r"rank \d crosses at t=([0-9.]+)", output))
    took = time.time() - crossed_at
    print(f"torchrun, crossed collectives: torchrun exited {took:.1f} s after the mismatch")
    assert code != 0 and output.count("The ranks' last collectives differ") >= 2, output[-6000:]
    assert re.search(r"all_reduce #\d+ on world/dp/dp_cp\[0,1\] \(3,\) waiting", output), output[-6000:]
    assert re.search(r"broadcast #\d+ on world/dp/dp_cp\[0,1\] \(3,\) waiting", output), output[-6000:]
    assert took < CROSSED_TIMEOUT + 15, took


def test_resuming_twice_at_epoch_ends_is_exact(tmp_path):
    """A run resumed at an epoch's end, checkpointed at the next epoch's end and resumed from there, trains on
    the batches of an uninterrupted run (before the fix the last resume repeated the previous epoch's order:
    Lightning's epoch counters are one behind after such a restart). One process under FourDStrategy, 4 batches
    per epoch, checkpoints taken at the last batch of an epoch (ModelCheckpoint every_n_train_steps): A runs
    steps 1-4 and saves step 4, B resumes it and saves step 8, C resumes that; the stitched losses and C's final
    weights equal the uninterrupted 12-step run's bit for bit."""
    from dataclasses import replace

    from tests.parity import Case, assert_exact_resume, train

    case = Case("twice", module="tests.models:Classifier", data="tests.models:classification_data", batch_size=16,
                max_steps=4, resume_at=4)
    first = train(case, distributed=True, workdir=str(tmp_path))["extras"]["uninterrupted"]  # A (and no resume)
    # B: from A's step 4 to step 12, saving at step 8 (every 8 steps), then C: resumed from B's step 8.
    chained = train(replace(case, name="b", max_steps=12, resume_at=8,
                            resume_from=str(next((tmp_path / "twice").glob("*step=4.ckpt")))),
                    distributed=True, workdir=str(tmp_path))
    second = chained["extras"]["uninterrupted"]  # B, steps 5-12
    uninterrupted = train(replace(case, name="whole", max_steps=12, resume_at=None), distributed=True)
    assert second["losses"] == uninterrupted["losses"][4:]  # one resume at an epoch's end was exact already
    third = chained["losses"][8:]  # C, steps 9-12
    assert_exact_resume(dict(chained, losses=first["losses"] + second["losses"][:4] + third,
                             extras={"uninterrupted": uninterrupted}))


def test_only_changed_buffers_are_broadcast(monkeypatch):
    """Every buffer on a fit's first step; after that only those changed in place since (BatchNorm's running
    statistics after a training forward), nothing for a step that changed none. Broadcasts are counted in one
    process standing for rank 0 of a replica group of two."""
    import torch.distributed as dist

    from lightning_4d.faults.callback import broadcast_buffers

    sent = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group: sent.append(tensor.numel()))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("table", torch.arange(6.0))  # never changes, like a rotary table
    versions: dict[int, int] = {}
    broadcast_buffers(model, "replicas", versions)
    assert sent == [4 + 4 + 6, 1]  # float buffers in one broadcast, num_batches_tracked (int64) in another
    sent.clear()
    broadcast_buffers(model, "replicas", versions)
    assert sent == []  # nothing changed
    model.train()(torch.randn(8, 4))  # updates the running statistics and the batch count
    broadcast_buffers(model, "replicas", versions)
    assert sent == [4 + 4, 1]
    sent.clear()
    model.eval()(torch.randn(8, 4))
    broadcast_buffers(model, "replicas", versions)
    assert sent == []
