"""A callback for the demo: print the loss every few steps, so a terminal without a live progress bar
(CI, a log file) shows the loss falling."""

import lightning as L


class PrintLoss(L.Callback):
    """On global rank 0, print ``train_loss`` at step 1 and every ``every_n_steps`` steps, and ``val_loss`` after each
    validation."""

    def __init__(self, every_n_steps: int = 5) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % self.every_n_steps == 0):
            print(f"step {step:4d}  train_loss {float(trainer.callback_metrics['train_loss']):.4f}", flush=True)
