"""``python -m lightning_4d.verify_checkpoint DIR``: check a checkpoint directory offline against its checksums
(:mod:`lightning_4d.checkpoint.verify`)."""

import sys

from lightning_4d.checkpoint.verify import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
