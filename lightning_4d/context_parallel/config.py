"""Context-parallel options, checked when ``FourDStrategy`` is constructed (and by the planner): a bad value
fails before processes start, with a message naming the argument, its value and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from lightning_4d.context_parallel.zigzag import _nearest_multiples
from lightning_4d.parallel_dims import ParallelDims

COMM_MODES = ("ring", "allgather", "a2a")
# The step check's sample: at most this many tokens of each sequence (rounded down to the zigzag multiple).
DEFAULT_CHECK_TOKENS = 1024
_EXAMPLES = {"cp_batch_keys": "input_ids", "cp_position_modules": "transformer.wpe", "cp_buffers": "model.cos"}


@dataclass(frozen=True)
class ContextParallelConfig:
    """The ``cp`` size and ``cp_*`` options of ``FourDStrategy``, validated on construction. The name lists
    (``None``: found automatically) are kept as tuples.

    comm: how keys and values travel: ``"ring"`` (blocks passed round the group), ``"allgather"``, or ``"a2a"``
    (Ulysses: all-to-all from sequence shards to head shards).
    seq_dim: the sequence dim of the batch's tensors. batch_keys: the batch entries to shard (dict keys, tuple
    indices as strings, dotted for nesting; ``None``: every tensor as long on ``seq_dim`` as the first one).
    position_modules: FQN globs of modules whose position input must see global positions. buffers: FQN globs
    of per-position tables that code slices by length. document_key: the batch entry holding a document id per
    token (packed sequences, for models that build their document mask from it). check: on the first training,
    validation and test batch, run the step on a sample sharded and whole and refuse a difference
    (:mod:`.step_check`); check_tokens: the sample's tokens per sequence at most. See
    ``docs/context_parallel.md``."""

    cp: int = 1
    comm: str = "ring"
    seq_dim: int = 1
    batch_keys: Optional[Sequence[Union[str, int]]] = None
    position_modules: Optional[Sequence[str]] = None
    buffers: Optional[Sequence[str]] = None
    document_key: Optional[str] = None
    check: bool = True
    check_tokens: int = DEFAULT_CHECK_TOKENS

    def __post_init__(self) -> None:
        ParallelDims.check_sizes(1, 1, self.cp, 1)
        if not isinstance(self.check, bool):
            raise ValueError(f"cp_check={self.check!r} must be True (on the first batch of training, validation and"
                             " test, run the step sharded and whole and refuse a difference from one process) or"
                             " False (no check).")
        if isinstance(self.check_tokens, bool) or not isinstance(self.check_tokens, int) or self.check_tokens <= 0:
            raise ValueError(f"cp_check_tokens={self.check_tokens!r} must be a positive number of tokens: the step"
                             f" check's sample keeps at most that many of each sequence (default"
                             f" {DEFAULT_CHECK_TOKENS}); to turn the check off use cp_check=False.")
        if self.comm not in COMM_MODES:
            raise ValueError(f"cp_comm={self.comm!r} is not a communication mode: use 'ring' (K/V blocks passed round"
                             " the group, O(L/cp) memory), 'allgather' (all K/V gathered at once, O(L) memory) or"
                             " 'a2a' (Ulysses: all-to-all to whole sequences of heads/cp heads; cp must divide the"
                             " heads).")
        seq_dim = self.seq_dim
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 0:
            raise ValueError(f"cp_seq_dim={seq_dim!r} must be the non-negative index of the sequence dim of the"
                             " batch's tensors (1 for [batch, seq, ...]).")
        if self.document_key is not None and not isinstance(self.document_key, str):
            raise ValueError(f"cp_document_key={self.document_key!r} must be the name of a batch entry (a dict key,"
                             " a tuple index as a string, dotted for nesting), e.g. cp_document_key='document_ids'.")
        for field, name in (("batch_keys", "cp_batch_keys"), ("position_modules", "cp_position_modules"),
                            ("buffers", "cp_buffers")):
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
                    isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
                raise ValueError(f"{name}={value!r} must be a list of names (or null for automatic detection),"
                                 f" e.g. {name}=[{_EXAMPLES[name]!r}].")
            object.__setattr__(self, field, tuple(value))

    def sequence_multiple(self, sequence_shards: int = 1) -> int:
        """Sequence lengths must be multiples of this: two zigzag chunks per cp rank, each split again into
        ``sequence_shards`` (``TensorParallelConfig.sequence_shards``: tp under sequence parallelism)."""
        return 2 * self.cp * sequence_shards

    def check_sequence_length(self, length: int, sequence_shards: int = 1, where: str = "the batch") -> None:
        """Refuse a sequence length the zigzag split (and sequence parallelism) cannot divide evenly."""
        check_sequence_length(length, self.cp, sequence_shards, where)


def check_sequence_length(length: int, cp: int, sequence_parallel: int = 1, where: str = "the batch") -> None:
    """Zigzag sharding needs two equal chunks per cp rank, which sequence parallelism splits over its tp ranks."""
    multiple = 2 * cp * sequence_parallel
    if length > 0 and length % multiple == 0:
        return
    rule = f"2*cp*tp = 2*{cp}*{sequence_parallel}" if sequence_parallel > 1 else f"2*cp = 2*{cp}"
    raise ValueError(f"Context parallelism needs sequence lengths that are multiples of {rule} = {multiple}, but"
                     f" {where} has length {length}. Pad or truncate sequences to"
                     f" {_nearest_multiples(length, multiple)} tokens.")
