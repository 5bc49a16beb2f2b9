"""A callback for tests/test_quiet_output.py: warns as a user's callback would (``rank_zero_warn`` at the start
of fit, on every rank: rank 0 must show it once), and saves a checkpoint the way a user's script does, with
``trainer.save_checkpoint(path)`` and no ``weights_only``."""

from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

PROBE_WARNING = "quiet probe: a warning of the user's own"


class SaveAtEnd(Callback):
    def on_fit_start(self, trainer, pl_module):
        rank_zero_warn(PROBE_WARNING)

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(Path(trainer.default_root_dir) / "end.ckpt")
