"""Console noise that is not ours to fix at the source, silenced once when the package is imported.

* Lightning's ``_pytree`` still builds ``torch.utils._pytree.LeafSpec``, which torch 2.13 deprecates with a
  ``FutureWarning`` on the first batch of every process: a 16-process run printed 16 identical copies. The
  process of global rank 0 keeps its copy (it is true, and not the user's to act on); the others drop it.
* Lightning's advertisements ("Tip: ... try installing litlogger/litmodels") are dropped on every rank.
* ``trainer.save_checkpoint(path)`` without ``weights_only`` logs "`weights_only` was not set, defaulting to
  `False`" on every rank; a full checkpoint (weights and training state) is what it means, so it is dropped.

Nothing else is filtered: a warning that only some ranks raise, or that rank 0 raises too, still shows.
Only the import, before any process group exists, decides the rank: from the launcher's environment
(``RANK`` of torchrun, ``LOCAL_RANK``/``NODE_RANK`` of Lightning's launcher, ``SLURM_PROCID``).
"""

from __future__ import annotations

import logging
import os
import warnings

LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_DROPPED_LOG_MESSAGES = {
    # logger name: message prefixes dropped from it
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip:",),
    "lightning.pytorch.trainer.connectors.checkpoint_connector": ("`weights_only` was not set",),
}


def launched_as_rank_zero() -> bool:
    """Whether the launcher's environment makes this process global rank 0 (true when it says nothing)."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) == 0
    return all(os.environ.get(key, "0") in ("", "0") for key in ("LOCAL_RANK", "NODE_RANK"))


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    """Install the filters above (idempotent)."""
    for name, prefixes in _DROPPED_LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))
    if not launched_as_rank_zero():
        warnings.filterwarnings("ignore", message=LEAF_SPEC_WARNING, category=FutureWarning)
