"""Train the example GPT from the command line: ``python examples/train.py fit --config examples/configs/demo.yaml``."""

import os
import sys

# Running this file as a script puts examples/ (not the repo root) on sys.path; Lightning's
# launcher re-runs the same script in each child process, so this line covers those too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_4d  # noqa: E402, F401  registers the "fourd" strategy name
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from examples.data import TextDataModule  # noqa: E402
from examples.gpt import GPT  # noqa: E402


def main() -> None:
    LightningCLI(GPT, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
