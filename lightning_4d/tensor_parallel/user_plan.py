"""A user's ``tp_plan`` mapping, checked and expanded from globs to the FQNs of the module it is for."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lightning_4d.tensor_parallel.plan import STYLES, ModuleStyle, _linear_shape, _pattern


def _parse_layout(text: str | None, where: str) -> Placement | None:
    if text is None:
        return None
    if text == "replicate":
        return Replicate()
    match = re.fullmatch(r"shard\((-?\d+)\)", str(text).replace(" ", ""))
    if match is None:
        raise ValueError(f"tp_plan entry {where!r}: layout {text!r} is not 'replicate' or 'shard(N)'.")
    return Shard(int(match.group(1)))


def _matches(pattern: str, fqn: str) -> bool:
    """Glob per dotted segment, as torch's parallelize_module does ('*' never crosses a dot)."""
    pattern_parts, parts = pattern.split("."), fqn.split(".")
    return len(pattern_parts) == len(parts) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, pattern_parts))


def _parse_user_plan(
    tp_plan: Mapping[str, Any], modules: dict[str, nn.Module], sequence_parallel: bool
) -> tuple[dict[str, ModuleStyle], list[str], dict[str, list[str]], dict[str, str]]:
    """Expand globs to FQNs; returns (styles, replicated FQNs, attributes to divide per FQN, the key that gave
    each FQN its style)."""
    styles: dict[str, ModuleStyle] = {}
    sources: dict[str, str] = {}
    replicated: list[str] = []
    divide: dict[str, list[str]] = {}
    names = [n for n in modules if n]
    for key, value in tp_plan.items():
        if isinstance(value, str):
            spec: dict[str, Any] = {"style": value}
        elif isinstance(value, Mapping):
            spec = dict(value)
        else:
            raise ValueError(f"tp_plan entry {key!r}: expected a style name or a mapping, got {value!r}.")
        unknown = set(spec) - {"style", "input", "output", "divide"}
        if unknown:
            raise ValueError(
                f"tp_plan entry {key!r}: unknown keys {sorted(unknown)}; allowed: style, input, output, divide."
            )
        style = spec.get("style")
        if style is not None and style not in STYLES:
            raise ValueError(f"tp_plan entry {key!r}: unknown style {style!r}; valid styles: {', '.join(STYLES)}.")
        if style is None and "divide" not in spec:
            raise ValueError(f"tp_plan entry {key!r} needs a 'style' ({', '.join(STYLES)}) or 'divide'.")
        if style == "sequence_parallel" and not sequence_parallel:
            raise ValueError(f"tp_plan entry {key!r}: style 'sequence_parallel' needs sequence_parallel=True.")
        for layout in ("input", "output"):
            _parse_layout(spec.get(layout), key)
        targets = [n for n in modules if _matches(key, n)]
        if not targets:
            close = difflib.get_close_matches(key, names, n=6, cutoff=0.4)
            close += [p for p in difflib.get_close_matches(key, sorted({_pattern(n) for n in names}), n=3, cutoff=0.4)]
            hint = f" Close module names: {', '.join(dict.fromkeys(close))}." if close else ""
            raise ValueError(f"tp_plan key {key!r} matches no module.{hint}")
        for fqn in targets:
            module = modules[fqn]
            if style in ("colwise", "rowwise") and not (
                _linear_shape(module) is not None or isinstance(module, nn.Embedding)
            ):
                raise ValueError(
                    f"tp_plan entry {key!r}: {fqn} is a {type(module).__name__}; '{style}' applies to "
                    "nn.Linear, transformers Conv1D and nn.Embedding only."
                )
            if style == "sharded_norm" and not (
                any(True for _ in module.parameters()) and not list(module.children())
                and all(p.dim() == 1 for p in module.parameters())
            ):
                raise ValueError(
                    f"tp_plan entry {key!r}: {fqn} is a {type(module).__name__}; 'sharded_norm' applies to a norm"
                    " with no submodules whose parameters are vectors over the features it normalizes (the"
                    " column-wise sharded output of a projection)."
                )
            if style == "replicate":
                replicated.append(fqn)
            elif style is not None:
                styles[fqn] = ModuleStyle(style, spec.get("input"), spec.get("output"), "user")
                sources[fqn] = key
            if "divide" in spec:
                names = spec["divide"]
                divide[fqn] = [names] if isinstance(names, str) else list(names)
    return styles, replicated, divide, sources

