"""What a step keeps and how it runs: activation checkpointing of the blocks (:mod:`.activation_checkpointing`)
and ``torch.compile`` of each block (:mod:`.compile`)."""

__all__ = ["activation_checkpointing", "compile"]  # its modules: import them by name
