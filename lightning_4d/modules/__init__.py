"""Model structures two dimensions both read: hand-written mixture-of-experts layers (:mod:`.experts`) and torch's
``nn.MultiheadAttention`` forwards (:mod:`.multihead_attention`)."""

__all__ = ["experts", "multihead_attention"]  # its modules: import them by name
