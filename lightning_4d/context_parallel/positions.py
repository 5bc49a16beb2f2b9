"""Where a module reads positions, found by name: learned position embeddings whose input must be the tokens'
global positions, and per-position tables that code slices by length (rotary cos/sin, ``freqs_cis``) and that
a context-parallel shard must index by its global positions instead."""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Iterator, Sequence
from typing import Optional

from torch import nn

# Automatic detection, by the last part of the name: learned position embeddings (nn.Embedding) ...
POSITION_EMBEDDING_NAMES = ("wpe", "pos_emb", "pos_embedding", "position_embedding", "position_embeddings",
                            "embed_positions")
# ... and per-position tables that code slices by length (litgpt's cos/sin, torchtitan's freqs_cis), and a
# rotary module's ``cache`` (torchtitan's RoPE modules since 0.3: ``layers.0.attention.rope.cache``).
POSITION_BUFFER_NAMES = ("cos", "sin", "cos_cached", "sin_cached", "freqs_cis")
ROTARY_CACHE_NAMES = ("cache",)


def find_position_modules(module: nn.Module, patterns: Optional[Sequence[str]] = None) -> dict[str, str]:
    """Modules whose position input gets global positions: FQN -> the name of that input.

    ``patterns`` are globs over FQNs; ``None`` detects learned position embeddings by name
    (:data:`POSITION_EMBEDDING_NAMES`) and rotary embeddings (``*rotary*`` with a ``position_ids`` input).
    """
    found = {}
    for fqn, sub in module.named_modules():
        last = fqn.rsplit(".", 1)[-1]
        if patterns is None:
            if isinstance(sub, nn.Embedding) and last in POSITION_EMBEDDING_NAMES:
                found[fqn] = _position_argument(fqn, sub)
            elif "rotary" in last.lower() and "position_ids" in _forward_parameters(sub):
                found[fqn] = "position_ids"
        elif fqn and any(fnmatch.fnmatchcase(fqn, p) for p in patterns):
            found[fqn] = _position_argument(fqn, sub)
    for pattern in patterns or ():
        if not any(fnmatch.fnmatchcase(fqn, pattern) for fqn in found):
            raise ValueError(f"cp_position_modules: {pattern!r} matches no module of {type(module).__name__};"
                             f" module names look like {_examples(n for n, _ in module.named_modules() if n)}.")
    return found


def _position_argument(fqn: str, sub: nn.Module) -> str:
    """The forward argument that carries positions: ``position_ids`` where the forward has one (OPT's learned
    embedding, an ``nn.Embedding`` subclass, takes an attention mask first and positions by that name), else
    an embedding's ``input``."""
    parameters = _forward_parameters(sub)
    if "position_ids" in parameters:
        return "position_ids"
    if isinstance(sub, nn.Embedding) and "input" in parameters:
        return "input"
    raise ValueError(f"cp_position_modules: {fqn} ({type(sub).__name__}) takes neither `position_ids` nor, as an"
                     f" nn.Embedding, `input` (its forward takes {', '.join(parameters) or 'nothing'}), so it has no"
                     " position input to map; name the module that receives the positions instead.")


def find_position_buffers(module: nn.Module, patterns: Optional[Sequence[str]] = None) -> list[str]:
    """FQNs of buffers indexed by position on dim 0; ``None`` detects them by name (:data:`POSITION_BUFFER_NAMES`,
    and a ``cache`` of a module named like a rotary embedding)."""
    names = [fqn for fqn, _ in module.named_buffers()]
    if patterns is None:
        return [fqn for fqn in names if fqn.rsplit(".", 1)[-1] in POSITION_BUFFER_NAMES or _rotary_cache(fqn)]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(fqn, pattern) for fqn in names):
            raise ValueError(f"cp_buffers: {pattern!r} matches no buffer of {type(module).__name__}; its buffers"
                             f" are {_examples(names)}.")
    return [fqn for fqn in names if any(fnmatch.fnmatchcase(fqn, p) for p in patterns)]


def _rotary_cache(fqn: str) -> bool:
    owner, _, name = fqn.rpartition(".")
    last = owner.rsplit(".", 1)[-1].lower()
    return name in ROTARY_CACHE_NAMES and ("rope" in last or "rotary" in last)

def _forward_parameters(module: nn.Module) -> list[str]:
    return list(inspect.signature(module.forward).parameters)


def _examples(names: Iterator[str] | list[str], limit: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") if names else "(none)"
