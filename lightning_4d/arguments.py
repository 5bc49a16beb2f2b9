"""Refusals of strategy arguments that need nothing but the values: a misspelled name, a size that is not a
positive number. Each message names the argument, the value and what to write instead."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable


def refuse_unknown(function: Callable[..., Any], unknown: dict[str, Any]) -> None:
    """Raise a ValueError naming each argument ``function`` does not take, with the closest one it does."""
    if not unknown:
        return
    known = [name for name, p in inspect.signature(function).parameters.items()
             if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    lines = []
    for name, value in unknown.items():
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known arguments: {', '.join(known)}."
        lines.append(f"unknown argument {name}={value!r}: {hint}")
    owner = function.__qualname__.split(".")[0]
    raise ValueError(f"{owner} got " + "; ".join(lines))


def positive(name: str, value: Any, what: str, integer: bool = False) -> None:
    """Refuse anything but a positive number (a whole one if ``integer``); ``what`` says what it counts."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of {what}.")
