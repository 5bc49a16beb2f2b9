"""Take a trained model out of the training layout.

A lightning-4d checkpoint is a directory of shards keyed by parameter names of the *unchanged* module, so
exporting needs no knowledge of the layout it was saved from:

    python -m lightning_4d.export CHECKPOINT_DIR model.ckpt
    python -m lightning_4d.export CHECKPOINT_DIR hf_dir --hf --module mypackage.model:MyModule

The single file is a Lightning checkpoint (``state_dict``, ``hyper_parameters``, ``epoch``, ...):
``module.load_state_dict(torch.load(path)["state_dict"])`` and ``MyModule.load_from_checkpoint(path)``
both work. ``--hf`` writes a Hugging Face model directory when the module wraps a ``PreTrainedModel``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_4d._cli import CLASS_SYNTAX, CommandLineError, fail, import_class

if TYPE_CHECKING:
    from torch import nn

# torch and the checkpoint module are imported inside the functions: ``--help`` and argument errors answer
# before torch is imported.


def read_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The whole checkpoint in this process: Lightning's metadata plus the full ``state_dict``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_4d.checkpoint.sharded import read_meta

    meta = read_meta(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(checkpoint_dir, merged)
        tensors = torch.load(merged, map_location="cpu", weights_only=True)
    return {**meta, "state_dict": tensors["state_dict"]}


def export_checkpoint(checkpoint_dir: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the checkpoint as one Lightning checkpoint file (weights and metadata, no optimizer state)."""
    import torch

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(read_checkpoint(checkpoint_dir), output)
    return output


def export_hugging_face(checkpoint_dir: str | os.PathLike, module: nn.Module, output_dir: str | os.PathLike) -> Path:
    """Load the weights into ``module`` and ``save_pretrained`` the Hugging Face model it wraps."""
    from transformers import PreTrainedModel

    module.load_state_dict(read_checkpoint(checkpoint_dir)["state_dict"])
    wrapped = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    if not wrapped:
        raise ValueError(f"{type(module).__name__} contains no transformers.PreTrainedModel to export with --hf.")
    wrapped[0].save_pretrained(output_dir)
    return Path(output_dir)


def main(argv: Optional[list[str]] = None) -> int:
    """The ``python -m lightning_4d.export`` command line; returns the exit status (2, with one line on stderr,
    for a bad argument or a known failure: no checkpoint there, a class that cannot be imported or built)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a lightning-4d checkpoint directory")
    parser.add_argument("output", help="the file to write, or the directory with --hf")
    parser.add_argument("--hf", action="store_true", help="write a Hugging Face model directory")
    parser.add_argument("--module", help=f"with --hf: the LightningModule class, {CLASS_SYNTAX} (e.g."
                                         " lightning_4d.demos.gpt:GPT); built with the checkpoint's hyper_parameters")
    args = parser.parse_args(argv)
    if args.hf and not args.module:
        fail(parser, f"--hf needs --module {CLASS_SYNTAX}, the class of the LightningModule that wraps the model.")
    if args.module and not args.hf:
        fail(parser, "--module is used only with --hf.")
    try:
        if args.hf:
            cls = import_class(args.module)
            from lightning_4d.checkpoint.sharded import read_meta

            hyper_parameters = read_meta(args.checkpoint).get("hyper_parameters") or {}
            try:
                module = cls(**hyper_parameters)
            except Exception as error:  # the user's constructor: any failure is reported in one line
                raise CommandLineError(f"--module {args.module}: {cls.__name__}(**hyper_parameters) failed:"
                                       f" {type(error).__name__}: {error}") from None
            path = export_hugging_face(args.checkpoint, module, args.output)
        else:
            path = export_checkpoint(args.checkpoint, args.output)
    except (CommandLineError, OSError, ValueError, ImportError) as error:
        fail(parser, error)
    print(f"wrote {path}")
    return 0

