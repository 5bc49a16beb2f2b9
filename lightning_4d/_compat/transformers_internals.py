"""transformers' private names that lightning-4d reaches: a model's attention implementation, its layers' own
checkpointing, its loss function, its weight initialization (for a model built on the meta device) and the
module-level MoE load-balancing loss of its modeling modules.

Split from :mod:`lightning_4d._compat` (which hands every name on) so that a transformers upgrade is adapted in one
file of its own; each entry says why no public API does the job. transformers is imported only inside the
functions that need it: lightning-4d runs without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

from torch import nn


# -------------------------------------------------------------------------------------------- transformers

# Which attention a Hugging Face model runs ('eager', 'sdpa', ...) and whether its class offers 'sdpa': public
# only as the ``attn_implementation`` argument of ``from_pretrained``/``from_config``, read back from the
# config's private attribute and the model class's flag. Context parallelism refuses 'eager' before any
# collective (its softmax is computed by hand, out of the reach of ring attention).
def hf_attention_implementation(model: Any) -> Optional[str]:
    """The attention implementation of a transformers ``PreTrainedModel`` (None for any other module)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if hasattr(model, "_supports_sdpa") else None


def hf_supports_sdpa(model: Any) -> bool:
    return bool(getattr(model, "_supports_sdpa", False))


# A layer's own checkpointing (``gradient_checkpointing_enable``): transformers keeps the checkpoint function
# it calls around each layer's ``__call__`` as a private attribute, a ``functools.partial`` of torch's checkpoint.
def hf_reentrant_checkpointing(layer: Any) -> bool:
    """Whether a transformers layer checkpoints itself reentrantly: ``use_reentrant=True``, or not given in
    ``gradient_checkpointing_kwargs`` (torch's checkpoint then defaults to reentrant)."""
    function = getattr(layer, "_gradient_checkpointing_func", None)
    return bool(getattr(layer, "gradient_checkpointing", False)) and \
        getattr(function, "keywords", {}).get("use_reentrant", True) is not False


def hf_loss_function(model: Any) -> Callable[..., Any]:
    """The loss a Hugging Face model's ``loss_function`` property returns, without its warning for an unset
    ``loss_type``: the one set on the instance (private ``_loss_function``), else HF's for its ``loss_type``,
    else ``ForCausalLMLoss`` (HF's own fallback)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    own = model.__dict__.get("_loss_function")
    return own if own is not None else LOSS_MAPPING.get(getattr(model, "loss_type", None)) or LOSS_MAPPING["ForCausalLM"]


# -------------------------------------------------------------------------------------- meta-device models

def hf_pretrained(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (checked by class, without importing transformers)."""
    return any(klass.__name__ == "PreTrainedModel" and klass.__module__.startswith("transformers")
               for klass in type(module).__mro__)


def hf_initialize_module(owner: nn.Module, module: nn.Module) -> None:
    """Hugging Face's own initialization of one ``module`` of the ``PreTrainedModel`` ``owner`` (what
    ``post_init`` -> ``initialize_weights`` does to every module), after clearing the ``_is_hf_initialized``
    flags that would make it skip the module: transformers sets them while a model is built, also on the meta
    device, where nothing was written. ``_init_weights`` and the flags are private; ``initialize_weights`` is
    public but runs on the whole model, not the modules one rank holds."""
    for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if tensor is not None and "_is_hf_initialized" in tensor.__dict__:
            del tensor.__dict__["_is_hf_initialized"]
    module.__dict__.pop("_is_hf_initialized", None)
    from transformers import initialization

    with initialization.guard_torch_init_functions():
        owner._init_weights(module)


def hf_balancing_loss_modules(module: nn.Module) -> list[Any]:
    """The transformers modeling modules of ``module``'s classes that compute the MoE load-balancing loss with
    their module-level ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE, Qwen3-MoE, ...), looked up by name."""
    import sys

    found = {}
    for m in module.modules():
        owner = sys.modules.get(type(m).__module__)
        if (owner is not None and owner.__name__.startswith("transformers.")
                and callable(getattr(owner, "load_balancing_loss_func", None))):
            found[owner.__name__] = owner
    return list(found.values())


@contextmanager
def module_function_replaced(owners: list[Any], name: str, replacement: Any) -> Iterator[None]:
    """``owners``' module-level function ``name`` replaced by ``replacement`` while the context is open."""
    saved = [(owner, getattr(owner, name)) for owner in owners]
    for owner, _ in saved:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, original in saved:
            setattr(owner, name, original)
