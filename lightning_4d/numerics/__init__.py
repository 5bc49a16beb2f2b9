"""One process's numbers under any layout: token-mean losses weighed over the ranks that split the batch
(:mod:`.token_losses`), logged values combined over context-parallel shards (:mod:`.step_logging`), and gradient
norms over shards, stages and repeated rows (:mod:`.clipping`)."""

__all__ = ["clipping", "step_logging", "token_losses"]  # its modules: import them by name
