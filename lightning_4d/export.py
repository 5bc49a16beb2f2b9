"""Take a trained model out of the training layout.

A lightning-4d checkpoint is a directory of shards keyed by parameter names of the *unchanged* module, so
exporting needs no knowledge of the layout it was saved from:

    python -m lightning_4d.export CHECKPOINT_DIR model.ckpt
    python -m lightning_4d.export CHECKPOINT_DIR hf_dir --hf --module lightning_4d.demos.gpt.GPT

The single file is a Lightning checkpoint (``state_dict``, ``hyper_parameters``, ``epoch``, ...):
``module.load_state_dict(torch.load(path)["state_dict"])`` and ``MyModule.load_from_checkpoint(path)``
both work. ``--hf`` writes a Hugging Face model directory when the module wraps a ``PreTrainedModel``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_4d.checkpoint import read_meta


def read_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The whole checkpoint in this process: Lightning's metadata plus the full ``state_dict``."""
    meta = read_meta(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(checkpoint_dir, merged)
        tensors = torch.load(merged, map_location="cpu", weights_only=True)
    return {**meta, "state_dict": tensors["state_dict"]}


def export_checkpoint(checkpoint_dir: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the checkpoint as one Lightning checkpoint file (weights and metadata, no optimizer state)."""
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


def _module_from(class_path: str, hyper_parameters: Optional[dict[str, Any]]) -> nn.Module:
    module_name, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**(hyper_parameters or {}))


def main(argv: Optional[list[str]] = None) -> None:
    """The ``python -m lightning_4d.export`` command line."""
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a lightning-4d checkpoint directory")
    parser.add_argument("output", help="the file to write, or the directory with --hf")
    parser.add_argument("--hf", action="store_true", help="write a Hugging Face model directory")
    parser.add_argument("--module", help="with --hf: the LightningModule class, e.g. mypkg.model.MyModule;"
                                         " built with the checkpoint's hyper_parameters")
    args = parser.parse_args(argv)
    if args.hf:
        if not args.module:
            parser.error("--hf needs --module, the class of the LightningModule that wraps the model")
        meta = read_meta(args.checkpoint)
        path = export_hugging_face(args.checkpoint, _module_from(args.module, meta.get("hyper_parameters")),
                                   args.output)
    else:
        path = export_checkpoint(args.checkpoint, args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
