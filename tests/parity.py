"""Parity harness: train a LightningModule on one process and under a 4D layout, then compare.

A :class:`Case` names a module factory, a data factory, the layout and the Trainer options. The reference runs
in the test process. Layouts run in worker processes (CPU, gloo) started once per world size: one launch runs
every case given to it in turn, because process start-up is the expensive part on a small machine.

Batches line up exactly: the layout's training sampler is Lightning's DistributedSampler over the ``dp``
replicas (shuffled with the global seed), and the reference draws from a one-replica DistributedSampler with
the same seed and ``dp`` times the batch size, so each reference step sees the union of the replicas' batches.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    name: str
    module: str  # "package.module:factory", called with **module_kwargs, returns a LightningModule
    data: str  # "package.module:factory", called with batch_size=..., train=bool, returns a Dataset
    strategy: dict[str, Any] = field(default_factory=dict)  # FourDStrategy arguments
    trainer: dict[str, Any] = field(default_factory=dict)  # extra Trainer arguments
    module_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 8  # global batch size: the reference's; each replica gets batch_size // dp
    max_steps: int = 5
    seed: int = 1234
    callbacks: list[str] = field(default_factory=list)  # "module:factory" probes with parity_extras(trainer)
    resume_at: Optional[int] = None  # checkpoint at this step, then resume from it in a new Trainer
    save_last: bool = False  # the ModelCheckpoint also keeps ``last.ckpt``
    resume_from: Optional[str] = None  # fit(ckpt_path=...): a checkpoint saved elsewhere, or "last"
    strategy_class: str = "lightning_4d:FourDStrategy"  # "module:class" built with **strategy when distributed
    empty_init: bool = False  # build the module under trainer.init_module(empty_init=True) (meta under 4D)


def _load(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


class Recorder(Callback):
    """Collects per-step losses and logged metrics on every rank; results are written by global rank 0."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[dict[str, float]] = []
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = (outputs["loss"] if isinstance(outputs, dict) else outputs).detach()
        if isinstance(loss, DTensor):  # a loss_parallel() loss, which ModelParallelStrategy cannot reduce
            loss = loss.full_tensor()
        loss = trainer.strategy.reduce(loss.clone(), reduce_op="mean")
        self.losses.append(float(loss))
        self.logged.append(_floats(trainer.callback_metrics))

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append(dict(_floats(trainer.callback_metrics), global_step=trainer.global_step))


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """The trained model's weights as plain tensors (gathered over shards and stages under FourDStrategy; a
    DTensor of another strategy, ModelParallelStrategy's, gathered whole)."""
    from torch.distributed.tensor import DTensor

    parallel = getattr(trainer.strategy, "parallel", None)
    state = parallel.full_state() if parallel is not None else trainer.lightning_module.state_dict()
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
            for key, value in state.items()}


def make_trainer(case: Case, *, distributed: bool, devices: int = 1, num_nodes: int = 1, recorder=None):
    import lightning.pytorch as pl

    callbacks = ([recorder] if recorder else []) + [_load(spec)() for spec in case.callbacks]
    options = dict(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_steps=case.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=False,
        callbacks=callbacks,
    )
    options.update(case.trainer)
    options["plugins"] = [_load(spec)() for spec in options.get("plugins", [])]  # "module:factory" each
    if distributed:
        options["strategy"] = _load(case.strategy_class)(**case.strategy)
    return pl.Trainer(**options)


def dataloaders(case: Case, dp: int, distributed: bool):
    from torch.utils.data import DataLoader, DistributedSampler

    make = _load(case.data)
    train, val = make(train=True), make(train=False)
    if distributed:
        return (DataLoader(train, batch_size=case.batch_size // dp, shuffle=True),
                DataLoader(val, batch_size=case.batch_size // dp))
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=case.seed)
    return DataLoader(train, batch_size=case.batch_size, sampler=sampler), DataLoader(val, batch_size=case.batch_size)


def train(case: Case, *, distributed: bool, devices: int = 1, num_nodes: int = 1,
          workdir: Optional[str] = None) -> dict[str, Any]:
    """Fit ``case`` in this process (as one rank of a layout when ``distributed``); return its record.

    With ``resume_at``, the run also writes a checkpoint at that step (ModelCheckpoint), and a second Trainer
    resumes from it: the record holds the resumed run, with the uninterrupted one under ``extras``.
    With ``resume_from``, the run starts from that checkpoint and the record holds only the steps after it.
    """
    record = _fit(case, distributed, devices, num_nodes, workdir, ckpt_path=case.resume_from)
    if case.resume_at is None:
        return record
    ckpt = next(Path(workdir).glob(f"{case.name}/*step={case.resume_at}.ckpt"))
    resumed = _fit(case, distributed, devices, num_nodes, None, ckpt_path=str(ckpt))
    resumed["losses"] = record["losses"][:case.resume_at] + resumed["losses"]
    resumed["logged"] = record["logged"][:case.resume_at] + resumed["logged"]
    resumed["epochs"] = [e for e in record["epochs"] if e["global_step"] <= case.resume_at] + resumed["epochs"]
    resumed["extras"]["uninterrupted"] = record
    return resumed


def _fit(case, distributed, devices, num_nodes, workdir, ckpt_path=None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(case.seed, workers=True, verbose=False)
    if case.strategy.get("compile"):
        # Each compiled case starts as a process of its own would: dynamo's caches of the blocks' code do not
        # tell an earlier case's checkpointing from this one's (see docs/compile.md).
        torch._dynamo.reset()
    module = None if case.empty_init else _load(case.module)(**case.module_kwargs)
    recorder = Recorder()
    trainer = make_trainer(case, distributed=distributed, devices=devices, num_nodes=num_nodes, recorder=recorder)
    if module is None:
        with trainer.init_module(empty_init=True):
            module = _load(case.module)(**case.module_kwargs)
    if workdir and (case.resume_at or case.save_last):
        trainer.callbacks.append(ModelCheckpoint(dirpath=Path(workdir) / case.name, save_top_k=-1,
                                                 every_n_train_steps=case.resume_at, save_last=case.save_last))
    # The layout's replicas, as the Trainer resolved them (ModelParallelStrategy: its data_parallel_size).
    dims = getattr(trainer.strategy, "parallel_dims", None)
    dp = 1 if not distributed else dims.dp if dims is not None else trainer.strategy._data_parallel_size
    train_loader, val_loader = dataloaders(case, dp, distributed)
    fit_kwargs = {"val_dataloaders": val_loader} if case.trainer.get("limit_val_batches") else {}
    trainer.fit(module, train_loader, ckpt_path=ckpt_path, **fit_kwargs)
    extras = {}
    for callback in trainer.callbacks:
        if hasattr(callback, "parity_extras"):
            extras.update(callback.parity_extras(trainer))
    return {
        "losses": recorder.losses,
        "logged": recorder.logged,
        "epochs": recorder.epochs,
        "weights": full_weights(trainer),
        "extras": extras,
        "rank": trainer.global_rank,
    }


_reference_cache: dict[str, dict[str, Any]] = {}


def reference(case: Case) -> dict[str, Any]:
    """Single-process run of ``case`` (cached: several layouts compare against one reference)."""
    case = replace(case, resume_at=None, save_last=False, resume_from=None, callbacks=[])
    key = json.dumps({k: v for k, v in asdict(case).items() if k not in ("name", "strategy", "strategy_class", "callbacks")},
                     sort_keys=True, default=str)
    if key not in _reference_cache:
        _reference_cache[key] = train(case, distributed=False)
    return _reference_cache[key]


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
# What this process's last test left behind, no business of a child: the running test's name and phase
# (pytest), and the seed of the last in-process run (``seed_everything``; a child seeds itself).
_THIS_PROCESS = ("PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that starts its own job: without the rendezvous variables an
    in-process Trainer earlier in the session left behind (its port is still taken by this process), and
    without the variables this process's tests change as they run. So every test's launches match the fork
    server's environment and are forked from it: a variable that differed per test started a new process
    importing torch and Lightning (~5 s of CPU) for each launch."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS + _THIS_PROCESS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def script_env(**extra: str) -> dict[str, str]:
    """:func:`child_env` for a script whose Trainer starts its own ranks (Lightning's launcher), with the
    ``MASTER_PORT`` a cluster would set, from :func:`free_port`: the port Lightning finds by itself (bind to
    port 0) can be taken by another worker's connections while the ranks import."""
    return child_env(MASTER_PORT=str(free_port()), **extra)


def _port_block() -> range:
    """This test process's own ports: below the kernel's ephemeral range, so no outgoing connection (gloo opens
    dozens per launch) is handed one between :func:`free_port` and the launch's store listening on it, and a
    block per xdist worker, so two workers never pick the same one. A port the kernel handed out as free (bind to
    port 0) was taken that way in CI: EADDRINUSE in rank 0, seconds after the check."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = 1000
    start = max(1024, low - size * (index + 1))
    return range(start, start + size)


_PORTS = _port_block()
_next_ports = itertools.cycle(_PORTS)


def free_port() -> int:
    """A port no launch of this process used lately and that nothing listens on now (see :func:`_port_block`)."""
    for _ in range(len(_PORTS)):
        port = next(_next_ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}: every one is taken on this machine")


@dataclass
class LaunchResult:
    returncodes: list[int]
    output: str  # every rank's stdout/stderr, the failing ranks' first
    results: dict[str, dict[str, Any]]  # case name -> rank 0's record, with "disagreement": the first rank whose
    # record differs from it (run_layout), or None
    errors: dict[str, list[str]]  # failing case name -> what each rank raised, by rank


def launch(argv: list[str], world_size: int, *, num_nodes: int = 1, timeout: float = 240,
           grace: float = 5, while_running: Optional[Callable[[], None]] = None) -> tuple[list[int], str]:
    """Start ``world_size`` processes the way a cluster scheduler would (LightningEnvironment variables), each
    forked from a process that imported torch and Lightning once per session (:mod:`tests.fork_ranks`).

    ``grace`` seconds after the first rank fails the others are killed, and ``timeout`` ends a hang: a launch
    never outlives its limit. (Fault tests raise ``grace`` to see the ranks stop by themselves.)
    ``while_running`` is called in this process once the ranks are started: work that would otherwise wait for
    them.
    """
    port = free_port()
    per_node = world_size // num_nodes
    base = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                     PYTHONUNBUFFERED="1")
    ranks = [dict(NODE_RANK=str(rank // per_node), LOCAL_RANK=str(rank % per_node), RANK=str(rank))
             for rank in range(world_size)]
    with tempfile.TemporaryDirectory() as tmp:
        logs = [str(Path(tmp, f"rank{rank}.log")) for rank in range(world_size)]
        start = time.monotonic()
        codes = Path(tmp, "codes.json")
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({"argv": argv, "envs": ranks, "logs": logs, "codes": str(codes), "grace": grace}))
        zygote = _ForkServer.start_launch(spec, base)
        try:
            if while_running is not None:
                while_running()
            zygote.wait(max(0.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(zygote.pid, signal.SIGKILL)  # the ranks share its process group
            zygote.wait()
        except BaseException:  # while_running failed: end the launch, and read its exit code off the server's
            with contextlib.suppress(ProcessLookupError):  # answers, which the next launch would take for its own
                os.killpg(zygote.pid, signal.SIGKILL)
            zygote.wait()
            raise
        known = json.loads(codes.read_text()) if codes.exists() else [None] * world_size
        returncodes = [-signal.SIGKILL if code is None else code for code in known]
        timed_out = time.monotonic() - start > timeout
        order = sorted(range(world_size), key=lambda r: (returncodes[r] == 0, r))
        chunks = [f"----- rank {rank} (exit {returncodes[rank]}) -----\n"
                  + (Path(logs[rank]).read_text(errors="replace") if Path(logs[rank]).exists() else "")
                  for rank in order]
    if timed_out:
        chunks.insert(0, f"TIMEOUT after {timeout:.0f} s: killed every rank\n")
    return returncodes, "\n".join(chunks)


class _ForkServer:
    """``python -m tests.fork_ranks --serve``: one process per test session that imported torch, Lightning and
    lightning_4d (~9 s of CPU) and forks each launch's ranks from there, instead of a new process importing
    them for every launch. It started with what a launch's environment would be but for the rendezvous
    variables (:func:`child_env`); a launch whose environment differs otherwise (a test that set a variable read
    at start-up, like ``MALLOC_MMAP_THRESHOLD_``) starts a process of its own, as before."""

    process: Optional[subprocess.Popen] = None
    env: dict[str, str] = {}
    answers = -1  # the read end of the server's answers: a pid, then an exit code, one line each
    buffered = b""
    started_alone = 0  # launches whose environment differed from the server's, each started in a process of its own

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @classmethod
    def start_launch(cls, spec: Path, base: dict[str, str]):
        """Start one launch; returns what ``wait(timeout)`` (raising ``subprocess.TimeoutExpired``) and
        ``pid`` (its process group) are asked of: the server's child, or a ``Popen`` of its own."""
        env = child_env(PYTHONUNBUFFERED="1")
        if cls.process is None or cls.process.poll() is not None:
            if cls.answers >= 0:
                os.close(cls.answers)
            read_fd, write_fd = os.pipe()
            cls.process = subprocess.Popen([sys.executable, "-m", "tests.fork_ranks", "--serve", str(write_fd)],
                                           cwd=ROOT, env=env, stdin=subprocess.PIPE, pass_fds=[write_fd],
                                           start_new_session=True, text=True)
            os.close(write_fd)
            cls.env, cls.answers, cls.buffered = env, read_fd, b""
        if env != cls.env:
            cls.started_alone += 1
            return subprocess.Popen([sys.executable, "-m", "tests.fork_ranks", str(spec)], cwd=ROOT, env=base,
                                    start_new_session=True)
        cls.process.stdin.write(json.dumps({"spec": str(spec), "env": base}) + "\n")
        cls.process.stdin.flush()
        return cls(cls._answer(None))

    @classmethod
    def _answer(cls, timeout: Optional[float]) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in cls.buffered:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([cls.answers], [], [], left)[0]:
                raise subprocess.TimeoutExpired("tests.fork_ranks launch", timeout)
            data = os.read(cls.answers, 4096)
            if not data:
                raise RuntimeError(f"the fork server ended (exit {cls.process.wait()}) during a launch")
            cls.buffered += data
        line, cls.buffered = cls.buffered.split(b"\n", 1)
        return int(line)

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._answer(timeout)


def run_layout(cases: list[Case], world_size: int, *, failing: list[Case] = (), num_nodes: int = 1,
               timeout: float = 300, workdir: Optional[str] = None, grace: float = 5,
               while_running: Optional[Callable[[], None]] = None) -> LaunchResult:
    """Train every case under its layout in one launch of ``world_size`` processes, then run the ``failing``
    cases, which must raise: each rank records what it raised (``LaunchResult.errors``), so that a test can
    check that every rank stopped, not only rank 0 (a rank that did not would hang its peers).

    Checkpoints written by ``resume_at`` cases go to ``workdir`` (kept) or to a temporary directory.
    """
    with nullcontext(workdir) if workdir else tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        spec = out / "cases.json"
        spec.write_text(json.dumps({"cases": [asdict(c) for c in cases], "failing": [asdict(c) for c in failing],
                                    "out": tmp, "num_nodes": num_nodes}))
        returncodes, output = launch(["-m", "tests.parity_worker", str(spec)], world_size, num_nodes=num_nodes,
                                     timeout=timeout, grace=grace, while_running=while_running)
        results = {case.name: torch.load(out / f"{case.name}.pt", weights_only=False)
                   for case in cases if (out / f"{case.name}.pt").exists()}
        for name, record in results.items():  # assert_parity fails a record whose ranks disagree
            record["disagreement"] = None
            for rank in range(1, world_size):
                path = out / f"{name}.rank{rank}.pt"
                if not path.exists():  # the rank failed: its exit code says so
                    continue
                try:
                    assert_same_record(name, rank, torch.load(path, weights_only=False), record)
                except AssertionError as disagreement:
                    record["disagreement"] = str(disagreement)
                    break
        errors = {case.name: [_read_outcome(out / f"{case.name}.rank{rank}.txt") for rank in range(world_size)]
                  for case in failing}
    return LaunchResult(returncodes, output, results, errors)


def assert_same_record(name: str, rank: int, got: dict[str, Any], first: dict[str, Any]) -> None:
    """Rank ``rank``'s losses, logged values and weights (its own replica's, gathered over its shards and stages)
    within fp32 round-off of rank 0's: a replica or a rank that drifted fails here, where rank 0's record alone
    could still match one process."""
    where = f"{name}: rank {rank} against rank 0"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(first["losses"]), rtol=1e-5, atol=1e-7,
                               msg=lambda m: f"{where}: losses: {m}")
    assert len(got["logged"]) == len(first["logged"]), (where, len(got["logged"]), len(first["logged"]))
    for index, (logged, ours) in enumerate(zip(got["logged"], first["logged"])):
        for key in logged.keys() & ours.keys():
            assert abs(logged[key] - ours[key]) <= 1e-5 * abs(ours[key]) + 1e-7, (
                f"{where}: logged[{index}] {key}: {logged[key]} vs {ours[key]}")
    assert set(got["weights"]) == set(first["weights"]), (where, set(got["weights"]) ^ set(first["weights"]))
    for key, value in first["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{where}: weight {key}: {m}")


def _read_outcome(path: Path) -> str:
    return path.read_text() if path.exists() else f"nothing recorded: {path.name} was not written"


def after_step(record: dict[str, Any], step: int) -> dict[str, Any]:
    """The part of a run after ``step``: what a run resumed from a checkpoint taken at ``step`` records."""
    return dict(record, losses=record["losses"][step:], logged=record["logged"][step:],
                epochs=[e for e in record["epochs"] if e["global_step"] > step])


def assert_parity(case: Case, expected: dict[str, Any], got: dict[str, Any], *, rtol: float = 1e-5,
                  atol: float = 1e-5, metrics: tuple[str, ...] = ("train_loss",),
                  epoch_metrics: tuple[str, ...] = ()) -> None:
    """Per-step losses, per-step ``metrics`` and end-of-epoch ``epoch_metrics`` within ``rtol`` relative;
    final weights within ``atol + rtol*|w|``; and every rank's record agreeing with rank 0's (``run_layout``)."""
    assert got.get("disagreement") is None, got["disagreement"]
    assert len(got["losses"]) == len(expected["losses"]) > 0, (case.name, got["losses"], expected["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"])):
        assert abs(a - b) <= rtol * abs(b) + 1e-7, f"{case.name}: loss at step {step}: {a} vs single-process {b}"
    for where, keys in (("logged", metrics), ("epochs", epoch_metrics)):
        assert len(got[where]) == len(expected[where]), (case.name, where, len(got[where]), len(expected[where]))
        for index, (logged, ref) in enumerate(zip(got[where], expected[where])):
            for key in keys:
                assert key in logged, f"{case.name}: {key!r} not in {where}[{index}] (has: {sorted(logged)})"
                assert abs(logged[key] - ref[key]) <= rtol * abs(ref[key]) + 1e-7, (
                    f"{case.name}: {where}[{index}] {key}: {logged[key]} vs single-process {ref[key]}")
    assert set(got["weights"]) == set(expected["weights"]), (case.name, set(got["weights"]) ^ set(expected["weights"]))
    for name, ref in expected["weights"].items():
        value = got["weights"][name]
        assert value.shape == ref.shape, f"{case.name}: {name} shape {tuple(value.shape)} vs {tuple(ref.shape)}"
        torch.testing.assert_close(value, ref, rtol=rtol, atol=atol, msg=lambda m: f"{case.name}: weight {name}: {m}")


def train_layout(cases: list[Case], world_size: int, **options: Any) -> dict[str, dict[str, Any]]:
    """``run_layout`` that fails the test unless every rank exited cleanly; each case's record by name."""
    records, _ = train_layout_with_failures(cases, [], world_size, **options)
    return records


def train_layout_with_failures(cases: list[Case], failing: list[Case], world_size: int,
                               **options: Any) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """``train_layout`` that also runs the ``failing`` cases; returns the records and, per failing case, what
    each rank raised (judge them with :func:`assert_error`)."""
    result = run_layout(cases, world_size, failing=failing, while_running=lambda: _references(cases), **options)
    assert all(code == 0 for code in result.returncodes), \
        f"ranks failed: {result.returncodes}\n{rank_tails(result.output)}"
    missing = [c.name for c in cases if c.name not in result.results]
    assert not missing, f"no result for {missing}\n{rank_tails(result.output)}"
    return result.results, result.errors


def rank_tails(output: str, chars: int = 3000) -> str:
    """The end of every rank's log in a launch's output (:func:`launch` puts failed ranks first), so that a rank
    that failed first shows, not only the last rank's log; without the list of extension modules that
    faulthandler prints after a crashed rank's stack."""
    head, *ranks = output.split("----- rank ")
    tails = [head] if head.strip() else []  # a timeout's line
    for part in ranks:
        title, _, log = part.partition("\n")
        log = "\n".join(line for line in log.split("\n") if not line.startswith("Extension modules:"))
        tails.append(f"----- rank {title}\n{log[-chars:]}")
    return "\n".join(tails)


def _references(cases: list[Case]) -> None:
    """The single-process references of ``cases``, computed (and cached) while their launch runs: the launch's
    ranks wait on one another and on start-up much of the time, and this process would otherwise wait too. A
    reference that fails here is left for the test to compute and report."""
    for case in cases:
        try:
            reference(case)
        except Exception:  # noqa: BLE001  the test calls reference(case) again and sees the error itself
            pass


def assert_error(outcomes: list[str], kind: str, phrases: list[str]) -> None:
    """Every rank raised ``kind`` with each of ``phrases`` in its message, so none waits in a collective."""
    assert outcomes, "no rank recorded an outcome"
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith(f"{kind}: "), (rank, outcome)
        for phrase in phrases:
            assert phrase in outcome, (rank, phrase, outcome)


def max_difference(expected: dict[str, Any], got: dict[str, Any]) -> tuple[float, float]:
    """The largest absolute difference of a per-step loss and of a final weight element between two runs."""
    loss = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"]))
    weight = max((got["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items())
    return loss, weight


def window_reference(case: Case) -> dict[str, Any]:
    """One process on each ``accumulate_grad_batches`` window's batches at once, without accumulation: what a
    layout matches under ``loss_normalization='tokens'``, which weighs every valid target of a window once."""
    trainer = {key: value for key, value in case.trainer.items() if key != "accumulate_grad_batches"}
    return reference(replace(case, trainer=trainer, batch_size=case.batch_size * case.trainer["accumulate_grad_batches"]))


def in_windows(case: Case, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (a layout's, one loss per batch) with one loss and one ``train_loss`` per accumulation window:
    the batches' token means weighted by their valid labels (the last tensor of a batch, -100 ignored), counted
    on the global batches in the order both runs draw them (one replica's sampler, ``set_epoch`` per epoch)."""
    k = case.trainer["accumulate_grad_batches"]
    loader, _ = dataloaders(case, 1, distributed=False)
    counts: list[float] = []
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        counts += [float((batch[-1] != -100).sum()) for batch in loader]
        if len(counts) >= len(record["losses"]):
            break

    def combine(values: list[float]) -> list[float]:
        return [sum(v * c for v, c in zip(values[i:i + k], counts[i:i + k])) / sum(counts[i:i + k])
                for i in range(0, len(values), k)]

    logged = combine([entry["train_loss"] for entry in record["logged"]])
    losses = combine([loss * k for loss in record["losses"]])  # the step's outputs, which Lightning divided by k
    return {**record, "losses": losses, "logged": [{"train_loss": value} for value in logged]}


def report_difference(case: Case, expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Print how close a layout came to the reference (seen with ``pytest -s``), before any assertion."""
    loss, weight = max_difference(expected, got)
    print(f"{case.name}: max |loss diff| {loss:.2e}, max |weight diff| {weight:.2e}")


def assert_exact_resume(record: dict[str, Any]) -> None:
    """A run resumed from its own checkpoint (``resume_at``) equals the uninterrupted run bit for bit."""
    uninterrupted = record["extras"]["uninterrupted"]
    assert record["losses"] == uninterrupted["losses"], (record["losses"], uninterrupted["losses"])
    assert record["weights"].keys() == uninterrupted["weights"].keys()
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(record["weights"][key], value), key


def spawn(worker: Callable[..., None], world_size: int, timeout: float, *args: Any) -> list[dict[str, Any]]:
    """Run ``worker(rank, world_size, out_dir, *args)`` in ``world_size`` spawned processes; each writes its
    measurements to ``out_dir/rank<rank>.json``, returned by rank. For tests that need a process group but not
    a Trainer. A hang is killed after ``timeout`` seconds and fails the test (it must not block the suite), as
    does a rank that exits non-zero or writes nothing.

    The processes come from a fork server that imported torch, Lightning and lightning_4d once (started on first
    use, kept for the session): each is a fresh process, not a copy of this test process, without paying the
    ~9 s of CPU those imports cost."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "lightning.pytorch", "lightning_4d"])
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [context.Process(target=worker, args=(rank, world_size, out_dir, *args)) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results = [_read_json(Path(out_dir, f"rank{rank}.json")) for rank in range(world_size)]
    finished = {rank: sorted(result) for rank, result in enumerate(results) if result is not None}
    assert not hung, f"ranks {hung} still running after {timeout:.0f} s (hang?); killed. Finished: {finished}"
    exitcodes = [proc.exitcode for proc in procs]
    assert exitcodes == [0] * world_size, f"exit codes {exitcodes}; finished: {finished}"
    assert None not in results, f"ranks {[r for r, res in enumerate(results) if res is None]} wrote no results"
    return results


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written, or cut off by a kill
        return None
