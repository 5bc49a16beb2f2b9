"""Start the ranks of one test launch by forking a process that has already imported torch and Lightning.

``python -m tests.fork_ranks SPEC`` (written by :func:`tests.parity.launch`): SPEC is a JSON file with the
command every rank runs (``["-m", "module", ...]`` or ``["script.py", ...]``), each rank's environment
variables and log file, where to write the exit codes, and the ``grace`` seconds after the first failure
before the other ranks are killed. Importing torch, Lightning and lightning_4d costs ~9 s of CPU per process;
forked ranks share one import, which on a 2-core machine is most of a short launch. Every rank is still its own
process with its own pid, environment and output, exactly as when each is started on its own.

``python -m tests.fork_ranks --serve FD`` keeps those imports for a whole test session: it reads one SPEC path
and its launch's environment (JSON, one line per launch) on stdin, forks a process that starts the ranks exactly
as ``python -m tests.fork_ranks SPEC`` would (a new session, so that a timeout kills it with its ranks), and
answers on file descriptor FD with that process's pid, then with its exit code once it ended.

A rank leaves as the interpreter's own exit would, up to its finalization (:func:`_leave`): thread pools told
to stop and its non-daemon threads joined, every ``atexit`` handler run (lightning_4d's process-group teardown
among them), output flushed; then ``os._exit``. Finalizing the interpreter a rank copied from the server (every module of torch, Lightning and
transformers, each page touched again and so copied) costs about 1.5 s of CPU per rank: 3 s of a 2-rank launch of
a short fit on 2 cores. What happens in finalization itself is tested with processes of their own:
``tests/test_teardown.py`` (Lightning's own launcher), the torchrun and example-script tests.

Exit codes are written as ranks end (``os.waitstatus_to_exitcode``: negative for a signal), so a launch that
the caller kills at its timeout still shows which ranks had finished.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

import lightning.pytorch  # noqa: F401  the imports every rank shares
import torch  # noqa: F401

from lightning_4d import _quiet  # and with it lightning_4d


def _run_rank(argv: list[str], env: dict[str, str], log: str) -> int:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.enable(all_threads=True)  # a rank killed by a signal (SIGSEGV in torch) leaves its stack in its log
    os.environ.update(env)
    _quiet.install()  # decided again from this rank's environment, as its own import would have
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _leave(code: int) -> None:
    """End this rank as ``sys.exit(code)`` would, but for the interpreter's finalization (module docstring).
    CPython's own two calls at exit, in its order (the test harness only, never the package):
    ``threading._shutdown`` first tells the thread pools' workers to stop (concurrent.futures registers that
    with it; inductor's compile pool is one) and joins the non-daemon threads; then the ``atexit`` handlers."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    argv, grace = spec["argv"], spec["grace"]
    if argv[0] == "-m":
        importlib.import_module(argv[1])  # its imports too; it runs again as __main__ in each rank
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}  # pid -> rank
    for rank, (env, log) in enumerate(zip(spec["envs"], spec["logs"])):
        pid = os.fork()
        if pid == 0:
            _leave(_run_rank(argv, env, log))
        ranks[pid] = rank
    codes: list = [None] * len(ranks)
    failed_at = None
    while None in codes:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            with open(spec["codes"] + ".tmp", "w") as out:
                json.dump(codes, out)
            os.replace(spec["codes"] + ".tmp", spec["codes"])
            if codes[ranks[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for other, rank in ranks.items():
                if codes[rank] is None:
                    os.kill(other, signal.SIGKILL)
            failed_at = float("inf")  # killed once; now reap them
        time.sleep(0.05)


def serve(answers: int) -> None:
    """One launch at a time, until stdin closes (the test session ended)."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _launch(request, answers)
        os.write(answers, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _launch(request: dict, answers: int) -> None:
    """The process of one served launch. Its ranks, forked in :func:`main`, leave it by their ``sys.exit`` and
    end through the interpreter's normal exit, as a process of their own would. The launch's process itself only
    waited for them: it leaves with ``os._exit``, since tearing down the interpreter it copied from the server
    (every module of torch, Lightning and transformers) costs about a second of CPU per launch."""
    launcher, code = os.getpid(), 1
    try:
        os.setsid()
        os.close(answers)
        os.environ.update(request["env"])
        main(request["spec"])
        code = 0
    except Exception:  # noqa: BLE001  the launch failed: say why, exit 1
        traceback.print_exc()
    finally:
        if os.getpid() == launcher:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
    else:
        main(sys.argv[1])
