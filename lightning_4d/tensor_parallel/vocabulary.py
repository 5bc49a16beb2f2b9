"""The vocabulary embedding and LM head of a plan, the weights tied between them, and how much of the rest the
plan shards (its coverage). Read by :func:`~lightning_4d.tensor_parallel.discovery.plan_tensor_parallel`."""

from __future__ import annotations

import math

import torch.nn as nn

from lightning_4d.tensor_parallel.plan import (_SEQUENCE_DIM, SHARDED_STYLES, Coverage, ModuleStyle, TensorParallelPlan,
                                              _is_conv1d, _linear_shape, _parameter_owners, _pattern, _under)


def plan_vocabulary(
    plan: TensorParallelPlan, modules: dict[str, nn.Module], replicated: list[str], sp: bool, loss_parallel: bool
) -> None:
    """Token embedding row-wise and the LM head (a linear C->V outside regions) column-wise."""
    embeddings = [f for f in modules if isinstance(modules[f], nn.Embedding)]
    if not embeddings:
        return
    outside = [f for f in modules if not _under(f, replicated) and not _under(f, list(plan.regions))]

    def heads_of(fqn: str) -> list[str]:
        """Linears outside the blocks that map the embedding's width back to its rows, tied to it first."""
        emb = modules[fqn]
        found = [f for f in outside
                 if _linear_shape(modules[f]) == (emb.embedding_dim, emb.num_embeddings) and f not in plan.styles
                 and not any(part.isdigit() for part in f.split("."))]  # an LM head is not inside repeated blocks
        return sorted(found, key=lambda f: getattr(modules[f], "weight", None) is not emb.weight)

    emb_fqn = max(embeddings, key=lambda f: _vocabulary_rank(f, modules, heads_of(f)))
    if _under(emb_fqn, replicated):
        return
    emb = modules[emb_fqn]
    vocab = emb.num_embeddings
    heads = heads_of(emb_fqn)
    if vocab % plan.tp_size:
        raise ValueError(
            f"Vocabulary size {vocab} of {emb_fqn} is not divisible by tp={plan.tp_size}. Fix: pad the vocabulary "
            f"to a multiple of {plan.tp_size} (e.g. {math.ceil(vocab / 64) * 64}), or keep it unsharded with "
            f"tp_plan: {{'{emb_fqn}': replicate{''.join(f', {h!r}: replicate' for h in heads[:1])}}}."
        )
    # The same table under several names (T5's shared, encoder.embed_tokens and decoder.embed_tokens): each
    # registration is called, so each is placed alike (and tied again to one parameter after sharding).
    for fqn in (f for f in embeddings if modules[f].weight is emb.weight and not _under(f, replicated)):
        plan.styles[fqn] = ModuleStyle(
            "rowwise", input="replicate", output=f"shard({_SEQUENCE_DIM})" if sp else "replicate", role="embedding"
        )
    if heads:
        plan.styles[heads[0]] = ModuleStyle("colwise", output=None if loss_parallel else "replicate", role="head")


def _vocabulary_rank(fqn: str, modules: dict[str, nn.Module], heads: list[str]) -> tuple:
    """Which embedding is the token embedding: the one with the most rows, not counting tables named for positions
    (learned positions can outnumber a small vocabulary: OPT's 2 offset rows, BERT's 512 positions); between equals,
    the one an LM head reads back (tied to it first)."""
    emb = modules[fqn]
    tied = bool(heads) and getattr(modules[heads[0]], "weight", None) is emb.weight
    positional = any(word in fqn.rsplit(".", 1)[-1] for word in ("position", "wpe", "pos_emb"))
    return not positional, emb.num_embeddings, tied, bool(heads)


def _weight_sharding(module: nn.Module, style: ModuleStyle | None) -> str:
    if style is None or style.style in ("sequence_parallel",):
        return "replicated"
    if isinstance(module, nn.Embedding):
        return f"shard({0 if style.style == 'rowwise' else 1})"
    conv = _is_conv1d(module)
    return f"shard({int(conv) if style.style == 'colwise' else int(not conv)})"


def check_ties(plan: TensorParallelPlan, module: nn.Module) -> None:
    """Parameters registered under several modules (a head tied to its embedding) must be placed alike, or the plan
    is refused with the styles that would keep them one parameter."""
    for owners in _parameter_owners(module).values():
        tied = [(fqn, name) for fqn, _, name in owners]
        # A registration in an unstyled module above a styled one is an alias that follows it (BERT's
        # cls.predictions.bias is its decoder's bias; the module's own code does not read it).
        tied = [(f, n) for f, n in tied
                if f in plan.styles or not any(g in plan.styles and g != f and _under(g, [f]) for g, _ in tied)]
        shardings = {
            (
                _weight_sharding(module.get_submodule(f), plan.styles.get(f))
                if n == "weight"
                else ("replicated" if f not in plan.styles else "sharded")
            )
            for f, n in tied
        }
        if len({f for f, _ in tied}) > 1 and len(shardings) > 1:
            names = ", ".join(f"{f}.{n}" for f, n in tied)
            raise ValueError(
                f"Tied parameters {names} would be sharded differently ({', '.join(sorted(shardings))}); tied weights "
                "must stay one parameter. Fix: give the tied modules matching tp_plan styles (embedding rowwise with "
                "LM head colwise), or replicate all of them."
            )


def coverage(plan: TensorParallelPlan, modules: dict[str, nn.Module]) -> Coverage:
    """The share of the body's parameters in modules the plan shards (column- or row-wise), and the body's
    largest modules left whole, grouped by FQN pattern (``model.layers.*.attn.qkv``)."""
    outside = [fqn for fqn, style in plan.styles.items() if style.role in ("embedding", "head")]
    sharded_modules = [fqn for fqn, style in plan.styles.items() if style.style in SHARDED_STYLES]
    sharded = total = 0
    whole: dict[str, list[int]] = {}
    for fqn, m in modules.items():
        if _under(fqn, outside):
            continue
        numel = sum(p.numel() for p in m.parameters(recurse=False))
        total += numel
        if _under(fqn, sharded_modules):
            sharded += numel
        elif numel:
            group = whole.setdefault(_pattern(fqn), [0, 0])
            group[0] += 1
            group[1] += numel
    largest = sorted(((pattern, count, numel) for pattern, (count, numel) in whole.items()), key=lambda r: -r[2])
    return Coverage(sharded, total, tuple(largest))
