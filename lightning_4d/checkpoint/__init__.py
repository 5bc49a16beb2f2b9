"""Checkpoints: sharded DCP save and load in any layout (:mod:`.sharded`), checksums and their verification
(:mod:`.integrity`, offline :mod:`.verify`), weights to start from in the forms people have them (:mod:`.pretrained`), export to one file or Hugging Face (:mod:`.export`), and the
data loader whose position is saved with them (:mod:`.resumable_loader`).

Names load on first use (PEP 562): ``python -m lightning_4d.export --help`` and ``... verify_checkpoint --help``
go through this package and answer before torch is imported.
"""

import importlib

_HOMES = {
    "sharded": ("META_FILE", "full_model_state", "load", "model_state", "optimizer_state",
                "read_meta", "remove", "save"),
    "pretrained": ("PretrainedWeightsError", "load_pretrained", "load_weights"),
    "integrity": ("CHECKSUM_FILE", "CorruptCheckpointError", "describe_problems", "expected_files", "verify",
                  "verify_collective"),
    "export": ("directory_message", "export_checkpoint", "export_hugging_face", "read_checkpoint"),
    "resumable_loader": ("ResumableDataLoader", "TrainLoaders", "make_resumable"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
