"""What the layout planner knows of a model: its sizes and where its parameters live, from sizes or read from a
module built on the meta device (:mod:`lightning_4d.plan` estimates memory and communication from these)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads")
KV_HEAD_ATTRIBUTES = ("n_kv_heads", "n_kv_head", "num_key_value_heads", "n_query_groups", "num_kv_heads")
VOCAB_PADDING = 128


class PlanError(ValueError):
    """A request no layout can satisfy; the message names the input and what to change."""


def check_positive(name: str, value: Any) -> None:
    """A size given to the planner is a positive integer (a PlanError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive integer.")


def check_heads(hidden: int, heads: int, kv_heads: int) -> None:
    """Heads split the hidden size evenly, and key/value heads the heads."""
    if hidden % heads:
        raise PlanError(f"hidden={hidden} is not divisible by heads={heads}: each head gets hidden/heads channels."
                        f" Change the hidden size or the head count (divisors of {hidden}: {divisors(hidden)}).")
    if heads % kv_heads:
        raise PlanError(f"heads={heads} is not a multiple of kv_heads={kv_heads}: grouped-query attention shares"
                        " each key/value head among an equal number of query heads.")


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the sizes a dimension of ``n`` ranks can take)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Model:
    """Sizes of a decoder-only transformer and its parameter counts by where they live."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    layer_matrix_params: int  # per block: 2-D weights, split by tp
    layer_vector_params: int  # per block: norm gains and other 1-D tensors, whole on every tp rank
    embedding_params: int  # token embedding, vocabulary-parallel, first stage
    head_params: int  # output head, vocabulary-parallel, last stage; 0 when tied to the embedding
    other_params: int  # final norm, position tables, ...: last stage, whole
    gated_mlp: bool = False  # SwiGLU-style: gate and up projections, their product feeds down
    # q, k and v in one projection: with fewer key/value heads than tp each rank holds one key/value head's k and
    # v rows (separate k and v projections are kept whole, every key/value head)
    fused_qkv: bool = False

    @property
    def params(self) -> int:
        return (self.layers * (self.layer_matrix_params + self.layer_vector_params) + self.embedding_params
                + self.head_params + self.other_params)

    @property
    def tied(self) -> bool:
        return self.head_params == 0

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single weight: the embedding, the head, or a block's MLP or q|k|v projection.
        A meta-built rank fills one tensor at a time, so this bounds what setup holds beyond the rank's share."""
        head_dim = self.hidden // self.heads
        attention = self.hidden * (self.hidden + 2 * self.kv_heads * head_dim) if self.fused_qkv else self.hidden ** 2
        return max(self.embedding_params, self.head_params, self.hidden * self.ffn_hidden, attention)

    @classmethod
    def from_sizes(cls, layers: int, hidden: int, heads: int, vocab: Optional[int] = None,
                   ffn_hidden: Optional[int] = None, kv_heads: Optional[int] = None, tied: bool = False,
                   params: Optional[int] = None, gated_mlp: bool = False) -> Model:
        """A GPT-style block without biases (``lightning_4d/demos/gpt.py``). With ``params`` but no ``vocab``, what the
        blocks do not account for is taken to be the embedding and head; with both, they must agree."""
        for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
            check_positive(name, value)
        kv_heads = heads if kv_heads is None else kv_heads
        ffn_hidden = 4 * hidden if ffn_hidden is None else ffn_hidden
        check_positive("kv_heads", kv_heads)
        check_positive("ffn_hidden", ffn_hidden)
        check_heads(hidden, heads, kv_heads)
        head_dim = hidden // heads
        mlp = (3 if gated_mlp else 2) * hidden * ffn_hidden
        matrices = hidden * (hidden + 2 * kv_heads * head_dim) + hidden * hidden + mlp
        vectors = 2 * hidden
        in_blocks = layers * (matrices + vectors) + hidden
        if vocab is None:
            if params is None:
                raise PlanError("give the vocabulary size (--vocab) or the total parameter count (--params):"
                                " the embedding and head size follow from either.")
            if params < in_blocks:
                raise PlanError(
                    f"params={params:,} is less than the {in_blocks:,} that {layers} layers of hidden size {hidden}"
                    f" (ffn {ffn_hidden}) hold: check --params, --layers, --hidden and --ffn-hidden.")
            vocab = (params - in_blocks) // (hidden if tied else 2 * hidden)
            vocab = max(VOCAB_PADDING, vocab // VOCAB_PADDING * VOCAB_PADDING)  # as vocabularies are padded for tp
        check_positive("vocab", vocab)
        total = in_blocks + vocab * hidden * (1 if tied else 2)
        if params is not None and abs(total - params) > 0.05 * params:
            raise PlanError(
                f"params={params:,} disagrees with the sizes, which give {total:,} ({layers} layers, hidden {hidden},"
                f" ffn {ffn_hidden}, vocab {vocab}{', tied' if tied else ''}): drop --params, or fix the sizes.")
        return cls(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn_hidden, vocab=vocab,
                   layer_matrix_params=matrices, layer_vector_params=vectors, embedding_params=vocab * hidden,
                   head_params=0 if tied else vocab * hidden, other_params=hidden, gated_mlp=gated_mlp)

    @classmethod
    def from_module(cls, module: Any) -> Model:
        """Counts read from a module (build it on the meta device: only shapes are needed).

        The blocks are the list pipeline parallelism splits (``lightning_4d.pipeline.find_blocks``), the token
        embedding the largest ``nn.Embedding``, the head a ``Linear`` with ``vocab`` outputs, the head and
        key/value head counts those tensor parallelism finds in the first block's attention
        (``tensor_parallel.discovery.find_regions``), else integer attributes such as ``n_head`` or a
        ``config.num_attention_heads``."""
        from torch import nn

        from lightning_4d.pipeline.plan import find_blocks

        try:  # the block list pipeline parallelism would split
            _, blocks = find_blocks(module, None)
        except ValueError as error:
            raise PlanError(f"cannot count the layers of {type(module).__name__}: {error} Or give the sizes instead"
                            " (--layers --hidden --heads --vocab).") from None
        embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if not embeddings:
            raise PlanError(f"{type(module).__name__} has no nn.Embedding to read the vocabulary and hidden size"
                            " from: give the sizes instead (--layers --hidden --heads --vocab).")
        token = max(embeddings, key=lambda m: m.num_embeddings)
        vocab, hidden = token.num_embeddings, token.embedding_dim
        block = next(iter(blocks.children()))
        attention = _attention_sizes(block)
        fused_qkv = bool(attention and attention[2])
        heads = attention[0] if attention else _find_int(block, HEAD_ATTRIBUTES) or _find_int(module,
                                                                                             HEAD_ATTRIBUTES)
        if heads is None:
            raise PlanError(f"could not find the number of attention heads of {type(module).__name__} (looked for"
                            f" {', '.join(HEAD_ATTRIBUTES)}): give it with --heads.")
        kv_heads = attention[1] if attention else (
            _find_int(block, KV_HEAD_ATTRIBUTES) or _find_int(module, KV_HEAD_ATTRIBUTES) or heads)
        check_heads(hidden, heads, kv_heads)
        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        widths = [m.in_features for m in linears if m.out_features == hidden and m.in_features != hidden]
        ffn_hidden = max(widths, default=4 * hidden)
        expanding = [m for m in linears if (m.in_features, m.out_features) == (hidden, ffn_hidden)]
        unique = {id(p): p for p in module.parameters()}
        in_blocks = {id(p) for p in blocks.parameters()}
        block_params = list({id(p): p for p in block.parameters()}.values())
        inside = {id(m) for m in blocks.modules()}
        head = next((m.weight for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in inside
                     and (m.in_features, m.out_features) == (hidden, vocab) and m.weight is not token.weight), None)
        embedding_params = token.weight.numel()
        head_params = 0 if head is None else head.numel()
        other = sum(p.numel() for i, p in unique.items()
                    if i not in in_blocks and p is not token.weight and p is not head)
        return cls(layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads,
                   ffn_hidden=ffn_hidden, vocab=vocab,
                   layer_matrix_params=sum(p.numel() for p in block_params if p.dim() >= 2),
                   layer_vector_params=sum(p.numel() for p in block_params if p.dim() < 2),
                   embedding_params=embedding_params, head_params=head_params, other_params=other,
                   gated_mlp=len(expanding) >= 2, fused_qkv=fused_qkv)


def _attention_sizes(block: Any) -> Optional[tuple[int, int, bool]]:
    """(heads, key/value heads, fused q|k|v) of the first attention region tensor parallelism finds in ``block``,
    as it counts them (names and shapes, head size from the module's attributes); None when it finds none."""
    from lightning_4d.tensor_parallel.discovery import find_regions

    try:
        regions = find_regions(block)
    except ValueError:  # an attention whose head count tensor parallelism cannot read: fall back to attributes
        return None
    return next(((r.heads, r.kv_heads, r.fused is not None) for r in regions.values()
                 if r.kind == "attention" and r.heads), None)


def _find_int(module: Any, names: Sequence[str]) -> Optional[int]:
    sources = [module, getattr(module, "config", None), getattr(module, "hparams", None)]
    for child in module.modules():
        sources += [child, getattr(child, "config", None)]
    for source in sources:
        for name in names:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
