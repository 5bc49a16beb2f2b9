"""Context parallelism: each cp rank holds a zigzag shard of every sequence (:mod:`.batches`), positions stay
global (:mod:`.positions`), and attention runs as ring attention (:mod:`.ring_attention`) through an interception
of ``scaled_dot_product_attention`` (:mod:`.apply`); what it cannot reach is refused first (:mod:`.reachability`)."""

from lightning_4d.context_parallel.apply import ContextParallel, SequencePositions, sequence_positions
from lightning_4d.context_parallel.attention_kernels import attention_kernels
from lightning_4d.context_parallel.batches import sequence_paths
from lightning_4d.context_parallel.config import COMM_MODES, ContextParallelConfig, check_sequence_length
from lightning_4d.context_parallel.masks import is_causal_mask
from lightning_4d.context_parallel.positions import find_position_buffers, find_position_modules
from lightning_4d.context_parallel.reachability import check_attention_reachable
from lightning_4d.context_parallel.ring_attention import ring_attention
from lightning_4d.context_parallel.zigzag import shard_sequence, unshard_sequence, zigzag_positions

__all__ = ["COMM_MODES", "ContextParallel", "ContextParallelConfig", "attention_kernels", "check_attention_reachable",
           "check_sequence_length", "find_position_buffers", "find_position_modules", "is_causal_mask",
           "ring_attention", "SequencePositions", "sequence_paths", "sequence_positions", "shard_sequence",
           "unshard_sequence", "zigzag_positions"]
