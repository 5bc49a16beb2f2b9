"""``python -m lightning_4d.export``: a checkpoint out of the training layout, into one file or a Hugging Face
directory (:mod:`lightning_4d.checkpoint.export`, whose functions answer here too, as before the move)."""

import sys

from lightning_4d.checkpoint.export import export_checkpoint, export_hugging_face, main, read_checkpoint

__all__ = ["export_checkpoint", "export_hugging_face", "main", "read_checkpoint"]

if __name__ == "__main__":
    sys.exit(main())
