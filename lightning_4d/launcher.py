"""Start the other ranks of a node by forking the launching process (``FourDStrategy(start_method="fork")``).

Lightning's default launcher on one machine re-runs the script once per extra rank, and each of those
processes imports torch and Lightning again: on a small CPU machine that start-up is most of a short run
(16 ranks on 2 cores spend over a minute importing). A forked rank starts with everything the launching
process already imported and built, so it begins training at once.

The launching process stays rank 0 and runs the Trainer's function itself, exactly as with the default
launcher: after ``fit`` its module and Trainer are rank 0's, and nothing has to be shipped back. A rank that
fails ends the run: a watcher in the launching process stops every rank, naming the rank and its exit code;
a rank that raises records the failure for its peers (:func:`lightning_4d.faults.report_failure`) first.

Forking is for CPU processes: a process that has initialised CUDA cannot be forked safely, so GPUs keep the
default launcher (or torchrun).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_4d import _quiet

START_METHODS = ("popen", "fork")


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> Optional[dist.Store]:
    """Under ``torchrun`` on one node, the store this attempt's process group is made on: the agent's store,
    under a name of the attempt's own. torch's agent (2.13) keeps one store for every attempt of a
    ``--max-restarts`` run, and restarted ranks setting up their process group read the killed attempt's
    connection keys (of 8 restarts measured here without this, 1 failed with "Connection refused" and 2 hung).
    ``TORCHELASTIC_RESTART_COUNT`` names the attempt: on one node a single agent sets it for every rank. With
    several agents a replaced node counts from 0 again, so there torch's own set-up is kept (None) and rank 0
    says what avoids the shared store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no agent store: rank 0 hosts a new store for each attempt
    if os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout)
        return dist.PrefixStore(f"lightning_4d/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if rank == 0 and restarts.isdigit() and int(restarts):
        print(f"[lightning-4d] torchrun --max-restarts {restarts} on several nodes shares one rendezvous store"
              " between attempts, and a restarted attempt may fail or hang setting up its process group on the"
              " killed one's keys. Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
              " (docs/checkpoints.md, \"Automatic restarts\").", file=sys.stderr, flush=True)
    return None


def check_start_method(start_method: str) -> str:
    """Refuse an unknown start method when the strategy is made, before any process starts; else return it."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not supported: use 'popen' (the default: every rank"
                         " runs the script again, as Lightning's DDP does) or 'fork' (CPU only: the other ranks are"
                         " forked from the launching process, which skips their start-up).")
    if start_method == "fork" and "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError("start_method='fork' is not available on this platform: use start_method='popen'.")
    return start_method


class ForkLauncher:
    """Forks ranks ``1 .. num_processes - 1`` of this node and runs rank 0 in the launching process.

    It is what Lightning asks of a launcher (``launch``, ``kill``, ``is_interactive_compatible``)."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._watcher: Optional[threading.Thread] = None
        self._done = threading.Event()

    @property
    def is_interactive_compatible(self) -> bool:
        return True  # nothing is re-run from a script, so a notebook works

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        if strategy.root_device.type != "cpu":
            raise ValueError(f"start_method='fork' starts CPU processes, but this run is on {strategy.root_device}"
                             ": a process that uses CUDA cannot be forked. Use start_method='popen' or torchrun.")
        environment = strategy.cluster_environment
        environment.validate_settings(num_devices=strategy.num_processes, num_nodes=strategy.num_nodes)
        os.environ.update(MASTER_ADDR=environment.main_address, MASTER_PORT=str(environment.main_port),
                          NODE_RANK=str(strategy.node_rank), WORLD_SIZE=str(strategy.num_processes * strategy.num_nodes))
        if "OMP_NUM_THREADS" not in os.environ:  # as Lightning's launchers do: no oversubscribed cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // strategy.num_processes))
        sys.stdout.flush()
        sys.stderr.flush()  # or a forked rank would print what is still buffered here again
        context = multiprocessing.get_context("fork")
        self.procs = [context.Process(target=self._run_rank, args=(local_rank, function, args, kwargs),
                                      name=f"lightning-4d rank {local_rank}", daemon=False)
                      for local_rank in range(1, strategy.num_processes)]
        for process in self.procs:
            process.start()
        self._done.clear()
        self._watcher = threading.Thread(target=self._watch, name="lightning-4d fork watcher", daemon=True)
        self._watcher.start()
        try:
            result = function(*args, **kwargs)
        except BaseException:
            self._done.set()
            self.kill(signal.SIGKILL)
            raise
        self._join()
        return result

    def _run_rank(self, local_rank: int, function: Callable, args: tuple, kwargs: dict) -> None:
        os.environ["LOCAL_RANK"] = str(local_rank)
        _quiet.install(rank_zero=False)  # what every rank would print again stays on rank 0
        try:
            function(*args, **kwargs)
        except BaseException as error:
            self._strategy.on_exception(error)
            raise

    def _watch(self) -> None:
        """Stop every rank as soon as one forked rank exits with an error (its peers would wait for it)."""
        while not self._done.wait(0.5):
            for local_rank, process in enumerate(self.procs, start=1):
                if process.exitcode not in (None, 0):
                    print(f"lightning-4d: rank {local_rank} (pid {process.pid}) exited with code {process.exitcode};"
                          " stopping every rank of this node.", file=sys.stderr, flush=True)
                    self.kill(signal.SIGKILL)
                    os._exit(1)

    def _join(self, timeout: float = 120.0) -> None:
        """Rank 0 finished: wait for the others to finish too, and fail naming any that did not."""
        for process in self.procs:
            process.join(timeout)
        self._done.set()
        failed = [(rank, process.exitcode) for rank, process in enumerate(self.procs, start=1) if process.exitcode != 0]
        if failed:
            self.kill(signal.SIGKILL)
            raise RuntimeError("lightning-4d: rank 0 finished but " + ", ".join(
                f"rank {rank} {'did not finish' if code is None else f'exited with code {code}'}" for rank, code in failed)
                + "; see their output above.")

    def kill(self, signum: int) -> None:
        for process in self.procs:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signum)
