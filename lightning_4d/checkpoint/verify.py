"""Check a lightning-4d checkpoint directory offline, without loading it:

    python -m lightning_4d.verify_checkpoint checkpoints/epoch=0-step=500.ckpt

exits 0 when every file matches the size and CRC-32 it was written with, 2 with a one-line message naming the
damaged files and the tensors in them otherwise.
"""

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """The command line; returns the exit status (0 intact, 2 damaged or not a checkpoint)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.verify_checkpoint",
                                     description="Check every file of a lightning-4d checkpoint directory against"
                                                 " the size and checksum it was written with: exit 0 if intact,"
                                                 " 2 with a one-line message otherwise.")
    parser.add_argument("directory")
    args = parser.parse_args(argv)
    # torch only once the arguments are read: --help and argument errors answer at once
    from lightning_4d.checkpoint.integrity import (CHECKSUM_FILE, CorruptCheckpointError, describe_problems,
                                                   expected_files, verify)
    from lightning_4d.checkpoint.sharded import META_FILE

    directory = Path(args.directory)
    if not (directory / META_FILE).is_file():
        print(f"{directory}: not a lightning-4d checkpoint directory (no {META_FILE})", file=sys.stderr)
        return 2
    try:
        if expected_files(directory) is None:
            print(f"{directory}: no {CHECKSUM_FILE} (written before checksums); cannot verify", file=sys.stderr)
            return 2
        problems = verify(directory)
    except CorruptCheckpointError as error:
        print(str(error), file=sys.stderr)
        return 2
    if problems:
        print(describe_problems(directory, problems), file=sys.stderr)
        return 2
    count = len(expected_files(directory))
    print(f"{directory}: OK ({count} files match their checksums)")
    return 0

