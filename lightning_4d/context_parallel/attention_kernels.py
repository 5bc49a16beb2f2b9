"""Attention modules that call a kernel other than ``F.scaled_dot_product_attention`` (FlexAttention's
``flex_attention``, a variable-length kernel), found in their code without importing the library defining them.

Context parallelism turns only scaled-dot-product attention into ring attention; such a kernel would attend
over each rank's shard of the sequence only, so :func:`lightning_4d.context_parallel.check_attention_reachable`
refuses these modules before any collective.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Optional

from torch import nn

# (module, name) of the torch kernels that attend without going through scaled_dot_product_attention.
_KERNELS = (("torch.nn.attention.flex_attention", "flex_attention"), ("torch.nn.attention.varlen", "varlen_attn"))
# Kernels of other packages, recognised by the name of the function called (flash-attn's own entry points).
_KERNEL_NAMES = ("flex_attention", "varlen_attn", "flash_attn_func", "flash_attn_varlen_func")
_DEPTH = 3  # calls followed from a forward: FlexAttention.forward -> compiled_flex_attn -> _compiled_flex_attn


def _torch_kernels() -> dict[int, str]:
    found = {}
    for module, name in _KERNELS:
        try:
            found[id(getattr(importlib.import_module(module), name))] = f"{module}.{name}"
        except (ImportError, AttributeError):  # an older torch without it: nothing can call it either
            continue
    return found


def _in_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def _kernel_of(cls: type, function: Callable, kernels: dict[int, str], depth: int, seen: set[int]) -> Optional[str]:
    """The kernel ``function`` calls, following the global and class-attribute names its code uses."""
    try:
        function = inspect.unwrap(function)  # torch.compile(flex_attention) wraps it
    except ValueError:
        return None
    if id(function) in kernels:
        return kernels[id(function)]
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen:
        return None
    if getattr(function, "__name__", "") in _KERNEL_NAMES:
        return f"{getattr(function, '__module__', '?')}.{function.__name__}"
    seen.add(id(code))
    if depth == 0 or _in_torch(getattr(function, "__module__", None) or ""):
        return None
    scope = getattr(function, "__globals__", {})
    for name in sorted(_names(code)):
        target = scope.get(name)
        if target is None:
            target = inspect.getattr_static(cls, name, None)
            target = target.__func__ if isinstance(target, (staticmethod, classmethod)) else target
        if callable(target) and not inspect.isclass(target):
            found = _kernel_of(cls, target, kernels, depth - 1, seen)
            if found:
                return found
    return None


def attention_kernels(module: nn.Module) -> dict[str, tuple[str, str]]:
    """FQN -> (class name, kernel) of the modules whose ``forward`` calls an attention kernel other than
    ``F.scaled_dot_product_attention`` (torch's own modules are not searched)."""
    kernels, by_class, found = _torch_kernels(), {}, {}
    for fqn, sub in module.named_modules():
        cls = type(sub)
        if _in_torch(cls.__module__):
            continue
        if cls not in by_class:
            by_class[cls] = _kernel_of(cls, cls.forward, kernels, _DEPTH, set())
        if by_class[cls]:
            found[fqn] = (cls.__name__, by_class[cls])
    return found
