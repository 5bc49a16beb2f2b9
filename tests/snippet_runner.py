"""Run documentation snippets as scripts, each in a process of its own forked from this one.

``python tests/snippet_runner.py SPEC`` (SPEC: JSON with ``snippets``, a list of ``{"where", "script", "port"}``, the
``preload`` modules, the per-snippet ``timeout`` and the ``out`` file). This process imports torch, Lightning,
lightning_4d and transformers once; each snippet then runs in a fresh fork as ``python SCRIPT`` would run it (its
own folder as working directory and ``sys.path[0]``, ``__name__ == "__main__"``, a fresh namespace, atexit
handlers at the end) without paying those imports again (6-10 s of CPU each). Ranks a snippet's Trainer starts
are new ``python SCRIPT`` processes, as for a user. A snippet's result is its exit code and its output, read until
every process holding it (the ranks too) has closed it, as ``subprocess.run(capture_output=True)`` reads; a
snippet still running after ``timeout`` seconds is killed with its ranks and fails.

Stdlib only until the preload: the snippets' environment is a user's (tests/test_docs.py), not this checkout.
"""

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback


def _run_child(script: str, port: int, write_fd: int) -> None:
    """In the fork: become the script and exit with its status (never return into the runner's loop). ``port``
    is the snippet's ``MASTER_PORT``, as a cluster sets it: one the test process picked outside the kernel's
    ephemeral range, where the port Lightning finds by itself could be taken by another worker's connections
    before the snippet's ranks listen on it."""
    code = 1
    try:
        os.environ["MASTER_PORT"] = str(port)
        os.setpgid(0, 0)  # the snippet and the ranks it starts: one group, killed together on a timeout
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        folder = os.path.dirname(script)
        os.chdir(folder)
        sys.argv = [script]
        sys.path[0] = folder
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001  the script's error, printed as Python prints it
            traceback.print_exc()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_one(script: str, port: int, timeout: float) -> dict:
    """Fork, run ``script`` in the child, collect its output until every writer closed it; kill on timeout."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _run_child(script, port, write_fd)
    os.close(write_fd)
    chunks, timed_out = [], False
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([read_fd], [], [], min(left, 1.0))
        if ready:
            data = os.read(read_fd, 65536)
            if not data:
                break  # every process of the snippet closed its output
            chunks.append(data)
    if timed_out:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    output = b"".join(chunks).decode(errors="replace")
    if timed_out:
        output += f"\nTIMEOUT after {timeout:.0f} s: killed the snippet and its ranks\n"
    return {"returncode": -9 if timed_out else os.waitstatus_to_exitcode(status), "output": output,
            "seconds": round(time.monotonic() - start, 1)}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path.pop(0)  # this file's folder (tests/): nothing of the checkout for the snippets
    for name in spec["preload"]:
        importlib.import_module(name)
    results = {}
    for snippet in spec["snippets"]:
        results[snippet["where"]] = run_one(snippet["script"], snippet["port"], spec["timeout"])
        with open(spec["out"], "w") as f:  # after each snippet: a runner killed later still reports the rest
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
