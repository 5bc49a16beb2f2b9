"""One process's numbers under any layout: token-mean losses weighed over the ranks that split the batch
(:mod:`.token_losses`), the LM head's cross entropy computed in chunks so that its logits never exist whole
(:mod:`.head_loss`, computed by :mod:`.chunked_cross_entropy`), logged values combined over context-parallel shards (:mod:`.step_logging`), and gradient
norms over shards, stages and repeated rows (:mod:`.clipping`)."""

__all__ = ["chunked_cross_entropy", "clipping", "head_loss", "step_logging", "token_losses"]  # its modules: import them by name
