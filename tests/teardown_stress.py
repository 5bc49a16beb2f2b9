"""Many launches of tests/teardown_script.py, outside the suite: the rate of runs that do not exit 0 on every rank.

    OMP_NUM_THREADS=1 python -m tests.teardown_stress [LAUNCHES]

The suite's tests/test_teardown.py runs a few launches; a rare abort needs many more to say anything, which this
prints: the launches, the failures (each with its output) and the time taken."""

import sys
import time

from tests.test_teardown import finished_cleanly


def main(launches: int) -> int:
    start, failures = time.monotonic(), 0
    for attempt in range(launches):
        problem = finished_cleanly()
        if problem is not None:
            failures += 1
            print(f"launch {attempt}: {problem}", flush=True)
    print(f"{launches} launches, {failures} not exiting 0 on every rank, {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
