"""``python -m lightning_4d.plan``: the layout planner's command line (:mod:`lightning_4d.planner.cli`), given the
strategy its ``--trials`` set up (the planner cannot import it: the strategy imports the planner). The
planner's names (``estimate``, ``Layout``, ``Model``, ``Training``, ``plan``, ...) answer here too, as they
did before the planner became a package."""

import sys

from lightning_4d.planner import *  # noqa: F401,F403  the planner's public names, under their old home
from lightning_4d.planner import __all__ as _planner_names
from lightning_4d.planner.cli import main

__all__ = [*_planner_names, "main"]

if __name__ == "__main__":
    sys.exit(main(strategy="lightning_4d.strategy:FourDStrategy"))  # imported by --trials only: --help stays light
