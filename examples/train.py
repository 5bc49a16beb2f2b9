"""Train the example GPT from the command line: ``python examples/train.py fit --config examples/configs/demo.yaml``.

The model, the data and the loss-printing callback live in :mod:`lightning_4d.demos`, so the configs name them as
``lightning_4d.demos.*`` and this script runs from any directory once the package is installed.
"""

from lightning.pytorch.cli import LightningCLI

import lightning_4d  # noqa: F401  registers the "fourd" strategy name
from lightning_4d.demos.data import TextDataModule
from lightning_4d.demos.gpt import GPT


def main() -> None:
    LightningCLI(GPT, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
