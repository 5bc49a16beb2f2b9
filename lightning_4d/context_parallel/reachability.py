"""Refusals before any collective: attention that context parallelism's interception cannot reach (other
kernels, Hugging Face attention implementations other than SDPA, torch's ``nn.MultiheadAttention`` variants)
and position code that reads the local length."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_4d import _compat as compat
from lightning_4d.context_parallel.attention_kernels import attention_kernels
from lightning_4d.modules.multihead_attention import unsupported


def check_attention_reachable(module: nn.Module, cp: int) -> None:
    """Refuse, before any collective, attention that context parallelism cannot turn into ring attention.

    torch's ``nn.MultiheadAttention.forward`` computes its attention inside ``F.multi_head_attention_forward``,
    itself a torch function: a function mode is off while its own handler runs, so the interception would not see
    the ``scaled_dot_product_attention`` inside it. :func:`~lightning_4d.composition.parallelize.parallelize` gives each
    instance lightning_4d's forward (:mod:`lightning_4d.modules.multihead_attention`), whose call is intercepted; the
    variants that forward does not compute are refused here. A module calling another
    kernel (``flex_attention``, a variable-length kernel: torchtitan's default FlexAttention, its
    VarlenAttention) is found in its code and refused likewise."""
    _check_no_relative_position_bias(module, cp)
    _check_hugging_face_attention(module, cp)
    kernels = attention_kernels(module)
    if kernels:
        fqn, (kind, kernel) = next(iter(kernels.items()))
        raise ValueError(
            f"cp={cp}: {fqn or 'the module'} ({kind}) computes attention with {kernel} ({len(kernels)} in"
            f" {type(module).__name__}), not through torch.nn.functional.scaled_dot_product_attention (the one call"
            " context parallelism turns into ring attention), so each rank's attention would see only its own"
            " tokens. Fix: build the model with an attention that calls scaled_dot_product_attention (torchtitan:"
            " model_registry(flavor, attn_backend='sdpa'), i.e. inner_attention=ScaledDotProductAttention.Config()),"
            " or use cp=1 (dp=N replicates the model instead).")
    for fqn, sub in module.named_modules():
        problem = unsupported(fqn, sub) if isinstance(sub, nn.MultiheadAttention) else None
        if problem is not None:
            raise ValueError(
                f"cp={cp}: {problem}, and torch's own forward calls scaled_dot_product_attention inside"
                " torch.nn.functional.multi_head_attention_forward, out of context parallelism's reach. Fix: build"
                " it without that option, or use cp=1 (dp=N replicates the model instead).")
        if _reads_its_length(sub):
            raise ValueError(
                f"cp={cp}: {fqn} (lightning.pytorch.demos' PositionalEncoding) adds pe[:, x.size(1)], the table's row"
                " at the sequence length, to every token: on a shard of each sequence it would add another row than"
                " on the whole sequence. Use cp=1 (dp=N replicates the model instead).")


def _check_no_relative_position_bias(module: nn.Module, cp: int) -> None:
    """Refuse an attention that adds a learned bias per (bucket of) query-key distance to its scores: T5's
    ``relative_attention_bias`` (MT5, UMT5, LongT5, Switch Transformers alike), an ``nn.Embedding(buckets,
    heads)``. Its code computes the distances from the lengths of the query and key it holds, on a shard not the
    whole sequence's, and the bias reaches scaled_dot_product_attention (transformers 5.24's 'sdpa') as a mask of
    the local shape, which ring attention cannot carry; transformers 5.3 offers T5 no 'sdpa' at all."""
    for fqn, sub in module.named_modules():
        table = getattr(sub, "relative_attention_bias", None)
        if isinstance(table, nn.Embedding) and type(sub).__name__.endswith("Attention"):
            raise ValueError(
                f"cp={cp}: {fqn} ({type(sub).__name__}) adds a learned relative-position bias to its attention"
                f" scores ({fqn}.relative_attention_bias: {table.num_embeddings} distance buckets x"
                f" {table.embedding_dim} heads), computed from the distances between the query and key positions it"
                " holds: on a shard of the sequence those are not the whole sequence's, and ring attention carries"
                " no such bias. Use cp=1 (dp=N replicates the model instead).")


def _reads_its_length(module: nn.Module) -> bool:
    """Lightning's demo PositionalEncoding, unless its table's rows are all alike (``pe`` is made lazily)."""
    if type(module).__name__ != "PositionalEncoding" or not type(module).__module__.startswith("lightning.pytorch"):
        return False
    table = getattr(module, "pe", None)
    return not isinstance(table, Tensor) or table.dim() < 2 or not bool((table == table[:, :1]).all())


def _check_hugging_face_attention(module: nn.Module, cp: int) -> None:
    """A Hugging Face model runs the attention its ``attn_implementation`` names; only 'sdpa' calls
    scaled_dot_product_attention. 'eager' computes its softmax by hand (Bloom always: it adds ALiBi to the scores
    itself); 'flex_attention', 'flash_attention_2' and the like call their own kernels. Refused here, naming the
    attention, rather than training each rank on its own tokens only."""
    for fqn, model in module.named_modules():
        implementation = compat.hf_attention_implementation(model)
        if implementation in (None, "sdpa"):
            continue
        attention = next((f"{fqn}.{name}".lstrip(".") + f" ({type(sub).__name__})"
                          for name, sub in model.named_modules() if type(sub).__name__.endswith("Attention")), None)
        if attention is None:  # Mamba, RWKV's successors, xLSTM, FNet, RecurrentGemma's recurrent layers
            raise ValueError(
                f"cp={cp}: {fqn or 'the module'} ({type(model).__name__}) holds no attention module: its layers mix"
                " the tokens another way (a state-space scan, a recurrence or a Fourier transform over the whole"
                " sequence), which context parallelism cannot split over ranks: it shards sequences only around"
                " torch.nn.functional.scaled_dot_product_attention, and each rank would see only its own tokens."
                " Use cp=1 (dp=N replicates the model instead).")
        fix = ("Load it with attn_implementation='sdpa', or use cp=1 (dp=N replicates the model instead)."
               if compat.hf_supports_sdpa(model) else
               f"{type(model).__name__} offers no attn_implementation='sdpa' (it computes its attention scores"
               " itself, e.g. with an ALiBi bias): use cp=1 (dp=N replicates the model instead).")
        how = "by hand" if implementation == "eager" else "with its own kernel"
        raise ValueError(
            f"cp={cp}: {attention} computes attention {how} ({fqn or 'the module'} ({type(model).__name__}) runs"
            f" Hugging Face's attn_implementation={implementation!r}), not through"
            " torch.nn.functional.scaled_dot_product_attention, so context parallelism cannot make it ring attention"
            f" and each rank would see only its own tokens. {fix}")

