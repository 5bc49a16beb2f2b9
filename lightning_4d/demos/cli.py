"""The LightningCLI of ``examples/train.py``: the demo GPT and text data, and ``fit --help`` that says how to
pick lightning-4d by its short name and pass its sizes.

jsonargparse resolves a class given by its bare name (``FourDStrategy``) and then takes its arguments; a
registered name such as ``fourd`` is a plain string to it, which takes no arguments. So::

    --trainer.strategy fourd                                   # FourDStrategy() with dp="auto"
    --trainer.strategy FourDStrategy --trainer.strategy.tp 2   # with sizes
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI, LightningArgumentParser

from lightning_4d import FourDStrategy  # noqa: F401  registers "fourd"; jsonargparse then resolves the class name
from lightning_4d.demos.data import TextDataModule
from lightning_4d.demos.gpt import GPT

STRATEGY_HELP = (" lightning-4d: 'fourd' (default sizes, dp='auto'), or with sizes 'FourDStrategy' followed by"
                 " --trainer.strategy.dp/pp/cp/tp N (in YAML: class_path: FourDStrategy, init_args: {tp: 2}).")


def describe_strategy_names(parser: LightningArgumentParser) -> None:
    """Append to the help of ``--trainer.strategy`` how to name lightning-4d's strategy, with and without sizes."""
    # argparse keeps a parser's options in its (documented-by-use, stable) ``_actions`` list; jsonargparse names
    # the Trainer's ``strategy`` option "trainer.strategy".
    for action in parser._actions:
        if action.dest == "trainer.strategy" and STRATEGY_HELP not in (action.help or ""):
            action.help = (action.help or "").rstrip() + STRATEGY_HELP


class FourDCLI(LightningCLI):
    """``LightningCLI`` whose ``--help`` names lightning-4d's strategy; otherwise unchanged."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        describe_strategy_names(parser)


def main(args: list[str] | None = None, run: bool = True) -> FourDCLI:
    """Train (or, with ``run=False``, only build) the demo GPT on the text DataModule from the command line."""
    return FourDCLI(GPT, TextDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})
