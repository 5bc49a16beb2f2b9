"""A callback for the demo: print the loss every few steps, so a terminal without a live progress bar
(CI, a log file) shows the loss falling."""

import lightning as L


class PrintLoss(L.Callback):
    """On global rank 0, print ``train_loss`` at step 1 and every ``every_n_steps`` steps, and ``val_loss`` after each
    validation (not the sanity check), with ``digits`` decimals."""

    def __init__(self, every_n_steps: int = 5, digits: int = 4) -> None:
        self.every_n_steps = every_n_steps
        self.digits = digits

    def _print(self, trainer: L.Trainer, name: str) -> None:
        if trainer.is_global_zero and name in trainer.callback_metrics:
            value = float(trainer.callback_metrics[name])
            print(f"step {trainer.global_step:4d}  {name} {value:.{self.digits}f}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 1 or step % self.every_n_steps == 0:
            self._print(trainer, "train_loss")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._print(trainer, "val_loss")
