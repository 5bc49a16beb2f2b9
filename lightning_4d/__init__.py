"""lightning-4d: data, tensor/sequence, context and pipeline parallelism for unchanged LightningModules.

Importing the package registers the strategy name ``"fourd"`` (``Trainer(strategy="fourd")``,
``--trainer.strategy fourd``; with sizes: ``--trainer.strategy FourDStrategy --trainer.strategy.tp 2``) and
silences console noise every rank would repeat (``lightning_4d._quiet``).

The command lines (``python -m lightning_4d.plan``, ``.export``, ``.verify_checkpoint``) import this package
first; for them the names below load on first use, so that ``--help`` answers before torch is imported.
"""

import sys

from lightning_4d import _quiet

__all__ = ["FourDStrategy", "GradientBuckets", "ParallelDims", "Telemetry", "sequence_positions"]
_COMMAND_LINES = ("lightning_4d.plan", "lightning_4d.export", "lightning_4d.verify_checkpoint")
_HOMES = {"FourDStrategy": "lightning_4d.strategy", "GradientBuckets": "lightning_4d.data_parallel",
          "ParallelDims": "lightning_4d.parallel_dims", "sequence_positions": "lightning_4d.context_parallel",
          "Telemetry": "lightning_4d.observability"}


def _running_our_command_line() -> bool:
    """One of our ``python -m`` command lines: Python imports this package while ``sys.argv[0]`` is ``-m``."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(sys, "orig_argv", []))
    for i, arg in enumerate(argv):
        if arg.startswith("-m"):
            target = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return target in _COMMAND_LINES
    return False


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_4d' has no attribute {name!r}")


_quiet.install()
if not _running_our_command_line():
    # Importing the strategy registers "fourd" with Lightning's StrategyRegistry.
    from lightning_4d.data_parallel import GradientBuckets
    from lightning_4d.context_parallel import sequence_positions
    from lightning_4d.observability import Telemetry
    from lightning_4d.parallel_dims import ParallelDims
    from lightning_4d.strategy import FourDStrategy
