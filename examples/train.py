"""Train the example GPT from the command line: ``python examples/train.py fit --config examples/configs/demo.yaml``.

The model, the data, the loss-printing callback and the CLI live in :mod:`lightning_4d.demos`, so the configs name
them as ``lightning_4d.demos.*`` and this script runs from any directory once the package is installed.
"""

from lightning_4d.demos.cli import main

if __name__ == "__main__":
    main()
