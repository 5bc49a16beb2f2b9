"""Console noise that is not ours to fix at the source, silenced once when the package is imported.

* Lightning's ``_pytree`` still builds ``torch.utils._pytree.LeafSpec``, which torch 2.13 deprecates with a
  ``FutureWarning`` on the first batch of every process: a 16-process run printed 16 identical copies. The
  process of global rank 0 keeps its copy (it is true, and not the user's to act on); the others drop it.
* Lightning's "[rank: N] Seed set to S" and "Initializing distributed: GLOBAL_RANK: N" lines, one per process,
  are kept on rank 0 only (rank 0 also prints "All distributed processes registered. Starting with N processes").
* Lightning's advertisements ("Tip: ... try installing litlogger/litmodels") are dropped on every rank.
* ``trainer.save_checkpoint(path)`` without ``weights_only`` logs "`weights_only` was not set, defaulting to
  `False`" on every rank; a full checkpoint (weights and training state) is what it means, so it is dropped.

Nothing else is filtered: a warning that only some ranks raise, or that rank 0 raises too, still shows.
The import, before any process group exists, decides the rank from the launcher's environment (``RANK`` of
torchrun, ``LOCAL_RANK``/``NODE_RANK`` of Lightning's launcher, ``SLURM_PROCID``).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Optional

LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
# logger name -> patterns (re.search) of messages dropped from it on every rank
_DROPPED = {
    "lightning.pytorch.utilities.rank_zero": (r"^💡 Tip:",),
    "lightning.fabric.utilities.rank_zero": (r"^💡 Tip:",),
    "lightning.pytorch.trainer.connectors.checkpoint_connector": (r"^`weights_only` was not set",),
}
# ... and on every rank but global rank 0
_DROPPED_OFF_RANK_ZERO = {
    "lightning.fabric.utilities.seed": (r"Seed set to ",),
    "lightning.fabric.utilities.distributed": (r"^Initializing distributed: GLOBAL_RANK",),
}


def launched_as_rank_zero() -> bool:
    """Whether the launcher's environment makes this process global rank 0 (true when it says nothing)."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) == 0
    return all(os.environ.get(key, "0") in ("", "0") for key in ("LOCAL_RANK", "NODE_RANK"))


class _DropMessages(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(str(record.msg))


def install(rank_zero: Optional[bool] = None) -> None:
    """Install the filters above (idempotent). ``rank_zero``: whether this process is global rank 0; by default
    what the launcher's environment says (a forked rank, whose environment is its parent's, passes ``False``)."""
    dropped = dict(_DROPPED)
    if not (launched_as_rank_zero() if rank_zero is None else rank_zero):
        dropped.update(_DROPPED_OFF_RANK_ZERO)
        warnings.filterwarnings("ignore", message=LEAF_SPEC_WARNING, category=FutureWarning)
    for name, patterns in dropped.items():
        logger = logging.getLogger(name)
        drop = _DropMessages(patterns)
        if not any(isinstance(f, _DropMessages) and f.pattern == drop.pattern for f in logger.filters):
            logger.addFilter(drop)
