"""Take a trained model out of the training layout.

A lightning-4d checkpoint is a directory of shards keyed by parameter names of the *unchanged* module, so
exporting needs no knowledge of the layout it was saved from:

    python -m lightning_4d.export CHECKPOINT_DIR model.ckpt
    python -m lightning_4d.export CHECKPOINT_DIR hf_dir --format hf --module mypackage.model:MyModule

The single file is a Lightning checkpoint (``state_dict``, ``hyper_parameters``, ``epoch``, ...):
``module.load_state_dict(torch.load(path)["state_dict"])`` and ``MyModule.load_from_checkpoint(path)``
both work. ``--format hf`` (or ``--hf``) writes a Hugging Face directory, tensor by tensor: ``config.json`` when
the module wraps a ``PreTrainedModel``, and safetensors files of at most ``--max-shard-size`` with an index.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

from lightning_4d._cli import CLASS_SYNTAX, CommandLineError, fail, import_class

if TYPE_CHECKING:
    from torch import nn

# torch and the checkpoint module are imported inside the functions: ``--help`` and argument errors answer
# before torch is imported.


def directory_message(path: str) -> str:
    """What ``MyModule.load_from_checkpoint(<a directory>)`` says: how a sharded checkpoint becomes the one file
    it reads, or resumes as it is."""
    return (f"load_from_checkpoint({path!r}): that is a directory, and load_from_checkpoint reads one checkpoint"
            " file. A lightning-4d checkpoint (a directory of shards) becomes one with"
            f" `python -m lightning_4d.export {path} model.ckpt`, then MyModule.load_from_checkpoint('model.ckpt');"
            " or keep it sharded: Trainer(strategy=FourDStrategy(...)).fit(model, ckpt_path=...) resumes from it in"
            " any layout, and FourDStrategy(init_from=...) starts from its weights.")


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


DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def shard_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"``."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper().replace(" ", "")
    number = text.rstrip("KMGTIB")
    unit = text[len(number):]
    if not number or unit not in _UNITS:
        raise ValueError(f"max_shard_size {size!r}: write a number of bytes or e.g. '5GB', '500MB', '2GiB'.")
    return int(float(number) * _UNITS[unit])


def export_hugging_face(checkpoint_dir: str | os.PathLike, module: nn.Module, output_dir: str | os.PathLike,
                        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write the checkpoint's weights as a Hugging Face directory: size-sharded safetensors (``model.safetensors``,
    or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``) and, when ``module`` holds a
    ``transformers.PreTrainedModel``, its ``config.json`` (keys then relative to that model, a tied weight
    written once, as ``save_pretrained`` does). Tensor by tensor: the checkpoint is verified, then each output
    shard is read from the checkpoint's files alone and written, so this process never holds more than one
    output shard. ``module`` only names the keys and gives the config: it may be built on the meta device."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_4d.checkpoint.integrity import CorruptCheckpointError, describe_problems, verify
    from lightning_4d.checkpoint.sharded import read_meta

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    read_meta(checkpoint_dir)  # raises: not a checkpoint directory
    problems = verify(checkpoint_dir)
    if problems:
        raise CorruptCheckpointError(describe_problems(checkpoint_dir, problems))
    prefix, wrapped = "", None
    try:
        from transformers import PreTrainedModel

        found = [(name, m) for name, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    except ImportError:
        found = []
    if found:
        name, wrapped = found[0]
        prefix = f"{name}." if name else ""
    # A tied weight (one parameter, several names) is written under its first name only.
    first_name: dict[int, str] = {}
    tied = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.add(name)
        first_name.setdefault(id(param), name)
    stored = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    tensors = {}
    for key, meta in stored.items():
        if not key.startswith("state_dict.") or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key[len("state_dict."):]
        if name.startswith(prefix) and name not in tied:
            tensors[name[len(prefix):]] = (key, meta)
    if not tensors:
        raise ValueError(f"{checkpoint_dir} holds no weights under {prefix!r} to export.")
    limit = shard_bytes(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    for name, (_, meta) in tensors.items():
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*output_dir.glob("model*.safetensors"), output_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    files = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    weight_map, total = {}, 0
    for file, names in zip(files, shards):
        part = {tensors[name][0]: torch.empty(tensors[name][1].size, dtype=tensors[name][1].properties.dtype)
                for name in names}
        dcp.load(part, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
        out = {name: part[tensors[name][0]] for name in names}
        save_file(out, str(output_dir / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(names, file))
        del part, out
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if wrapped is not None:
        wrapped.config.save_pretrained(output_dir)
        generation = getattr(wrapped, "generation_config", None)
        if generation is not None and wrapped.can_generate():
            generation.save_pretrained(output_dir)
    return output_dir


class _MetaTrainer:
    """Just enough of a Trainer for a ``configure_model`` that builds under ``self.trainer.init_module()``: on the
    meta device, as ``FourDStrategy`` builds it."""

    @contextmanager
    def init_module(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        import torch

        with torch.device("meta"):
            yield


def _configure_on_meta(module: nn.Module, spec: str) -> None:
    """Run a LightningModule's own ``configure_model`` on the meta device, where the model is built there (the
    constructor left it out): the export then finds the Hugging Face model, its config and its key names."""
    import lightning.pytorch as pl
    import torch

    if not isinstance(module, pl.LightningModule) or type(module).configure_model is pl.LightningModule.configure_model:
        return
    module.trainer = _MetaTrainer()
    try:
        with torch.device("meta"):
            module.configure_model()
    except Exception as error:  # the user's hook: any failure is reported in one line
        raise CommandLineError(f"--module {spec}: {type(module).__name__}.configure_model() on the meta device failed:"
                               f" {type(error).__name__}: {error}. It may use only self.trainer.init_module() of the"
                               " Trainer; export from Python with export_hugging_face(checkpoint, module, out)"
                               " instead.") from None
    finally:
        module.trainer = None


def main(argv: Optional[list[str]] = None) -> int:
    """The ``python -m lightning_4d.export`` command line; returns the exit status (2, with one line on stderr,
    for a bad argument or a known failure: no checkpoint there, a class that cannot be imported or built)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a lightning-4d checkpoint directory")
    parser.add_argument("output", help="the file to write, or the directory with --format hf")
    parser.add_argument("--format", choices=("ckpt", "hf"), default=None,
                        help="ckpt (default): one Lightning checkpoint file; hf: a Hugging Face directory (config.json"
                             " and size-sharded safetensors with an index), for from_pretrained")
    parser.add_argument("--hf", action="store_true", help="the same as --format hf")
    parser.add_argument("--module", help=f"with --format hf: the LightningModule class, {CLASS_SYNTAX} (e.g."
                                         " lightning_4d.demos.gpt:GPT); built on the meta device with the"
                                         " checkpoint's hyper_parameters, it names the keys and gives config.json")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help=f"with --format hf: the largest safetensors file (default {DEFAULT_MAX_SHARD_SIZE})")
    args = parser.parse_args(argv)
    if args.hf and args.format == "ckpt":
        fail(parser, "--hf is --format hf: give one of them.")
    hf = args.hf or args.format == "hf"
    option = "--hf" if args.hf else "--format hf"
    if hf and not args.module:
        fail(parser, f"{option} needs --module {CLASS_SYNTAX}, the class of the LightningModule that wraps the model.")
    if args.module and not hf:
        fail(parser, "--module is used only with --format hf.")
    try:
        if hf:
            shard_bytes(args.max_shard_size)
            cls = import_class(args.module)
            from lightning_4d.checkpoint.sharded import read_meta

            hyper_parameters = read_meta(args.checkpoint).get("hyper_parameters") or {}
            import torch

            try:
                with torch.device("meta"):  # only names and the config are needed: no memory for the weights
                    module = cls(**hyper_parameters)
            except Exception as error:  # the user's constructor: any failure is reported in one line
                raise CommandLineError(f"--module {args.module}: {cls.__name__}(**hyper_parameters) failed:"
                                       f" {type(error).__name__}: {error}") from None
            _configure_on_meta(module, args.module)
            path = export_hugging_face(args.checkpoint, module, args.output, args.max_shard_size)
        else:
            path = export_checkpoint(args.checkpoint, args.output)
    except (CommandLineError, OSError, ValueError, ImportError) as error:
        fail(parser, error)
    print(f"wrote {path}")
    return 0

