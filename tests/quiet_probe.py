"""A callback for tests/test_quiet_output.py: saves a checkpoint the way a user's script does, with
``trainer.save_checkpoint(path)`` and no ``weights_only``."""

from pathlib import Path

from lightning.pytorch.callbacks import Callback


class SaveAtEnd(Callback):
    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(Path(trainer.default_root_dir) / "end.ckpt")
