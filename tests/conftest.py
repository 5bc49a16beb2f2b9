"""The order in which pytest-xdist hands the test files to its workers (``-n 2 --dist loadfile``).

A worker gets whole files, from the front of a queue, as it runs out of work. By default xdist queues files by
their number of tests, so the files with few but long tests (torchrun jobs, a 16-process launch, a teardown loop)
came last, and one worker ran the last of them alone while the other core idled: the final two minutes of a CI run
at 63% of the machine. The longest files go first instead (longest first, the usual rule for packing jobs onto
machines), the others after them in their usual order; with one process, or with a few files named, nothing
changes but the order.
"""

# Per-file time summed over its tests (setup included): junit times of a torch 2.13 and a torch 2.15 run of the
# suite on the 2-core machine, 2026-12-03, longest first. An estimate for ordering only: a stale entry costs balance.
LONGEST_FIRST = [
    "test_fault_tolerance.py",  # 280 s
    "test_restarts.py",  # 245 s
    "test_parity_matrix.py",  # 217 s
    "test_docs.py",  # 138 s
    "test_context_parallel.py",  # 111 s
    "test_zoo.py",  # 107 s
    "test_resharding.py",  # 106 s
    "test_head_loss.py",  # 100 s
    "test_async_checkpoint.py",  # 91 s
    "test_teardown.py",  # 90 s
    "test_compile.py",  # 84 s
    "test_cp_step_check.py",  # 73 s
    "test_host_syncs.py",  # 67 s
    "test_pretrained.py",  # 65 s
    "test_cp_masks.py",  # 61 s
    "test_adapters.py",  # 57 s
]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's reordering by number of tests: keep ours
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable: a file's tests keep their order
