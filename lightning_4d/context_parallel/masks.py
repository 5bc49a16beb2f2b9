"""What an attention mask built on a shard means for the whole sequence: padding, sliding windows, documents.

A model builds its attention mask from what it sees: under context parallelism, a zigzag shard of each
sequence, numbered 0..S-1 as if it were the whole. Causal order survives that (a shard's tokens are in
increasing global order), but a sliding window, a padding mask and packed documents are about global
positions and other ranks' keys, which the shard's mask cannot express. So the mask's values are not used;
its meaning is:

* :class:`SequenceFacts` holds, per step, the whole sequences' facts every cp rank has before sharding: the
  batch's 2-D ``attention_mask`` (padding), its ``position_ids`` (documents where they restart, as Hugging
  Face detects packed sequences) and a document-id tensor the user names (``cp_document_key``).
* :func:`explain` finds which combination of causal order, the calling attention layer's sliding window,
  padding and documents (a :class:`Reading`) gives exactly the mask the model built on this shard, numbering
  the shard as the model did; :meth:`SequenceFacts.mask` gives the same combination over the whole sequences
  (a :class:`~lightning_4d.context_parallel.sequence_mask.SequenceMask`). A mask no combination explains (a
  bias, a pattern of the model's own) is refused: its meaning on the whole sequence is unknown.
* Explaining reads the device. The model builds its masks the same way every step, so a kind of mask is
  explained once, and later ones are checked against that reading on the device (:func:`agrees`), the flag
  read a step later by the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from lightning_4d.context_parallel.document_layout import SequenceLayout
from lightning_4d.context_parallel.sequence_mask import SequenceMask

__all__ = ["AttentionLayer", "MaskReadings", "Reading", "SequenceFacts", "agrees", "attention_layer", "explain",
           "is_causal_mask", "packed_documents", "simplest", "unmasked"]


def packed_documents(position_ids: Tensor) -> Tensor:
    """Document index per token from position ids that restart (Hugging Face's packed-sequence rule: a new
    document wherever the position is not the previous one plus one)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@dataclass(frozen=True)
class AttentionLayer:
    """What a Hugging Face attention module says of its own mask: causal or not, and its sliding window."""

    causal: bool
    window: Optional[int]


def attention_layer(module: nn.Module) -> Optional[AttentionLayer]:
    """The :class:`AttentionLayer` of a Hugging Face attention module (``is_causal`` and a ``sliding_window``
    of its own or of its ``config``), None for any other module."""
    causal = getattr(module, "is_causal", None)
    config = getattr(module, "config", None)
    if not isinstance(causal, bool) or (not hasattr(module, "sliding_window") and config is None):
        return None
    if hasattr(module, "sliding_window"):  # per layer (Gemma 2/3, Qwen2: None on the global layers)
        window = module.sliding_window
    elif getattr(config, "use_sliding_window", True) is False:
        window = None
    else:  # Mistral: one window for every layer, in the config
        window = getattr(config, "sliding_window", None)
    return AttentionLayer(causal, window if isinstance(window, int) and not isinstance(window, bool) else None)


class SequenceFacts:
    """The whole sequences' padding, position ids and document ids of one step (rows of the current
    pipeline micro-batch selected with :meth:`select`), on the device and, as ``host``, the same in host memory
    (from the batch as the data loader gave it): masks made from them carry both (``SequenceMask.host``)."""

    def __init__(self, padding: Optional[Tensor], position_ids: Optional[Tensor], documents: Optional[Tensor],
                 positions: Tensor, host: Optional[tuple[Optional[Tensor], ...]] = None,
                 device_positions: Optional[Tensor] = None, layout: Optional[SequenceLayout] = None) -> None:
        self.padding, self.position_ids, self.documents = padding, position_ids, documents
        self.layout = layout  # the document-balanced layout of the shards (None: the zigzag), for the masks made
        self.host = host if host is not None else (padding, position_ids, documents)
        self.positions = positions  # global positions of this rank's tokens, in host memory
        self.device_positions = device_positions if device_positions is not None else positions
        self.rows = slice(None)
        self.pipelined = False  # rows are selected per micro-batch (known in forward only)

    def select(self, index: int, count: int) -> None:
        """Micro-batch ``index`` of ``count`` equal ones (pipeline parallelism) is running."""
        rows = next(t for t in (self.padding, self.position_ids, self.documents) if t is not None).size(0) // count
        self.rows = slice(index * rows, (index + 1) * rows)
        self.pipelined = True

    @property
    def empty(self) -> bool:
        return self.padding is None and self.position_ids is None and self.documents is None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The facts the step's batch has."""
        named = zip(("attention_mask", "position_ids", "documents"), (self.padding, self.position_ids, self.documents))
        return tuple(name for name, t in named if t is not None)

    def _whole(self, t: Optional[Tensor], batch: int) -> Optional[Tensor]:
        if t is None:
            return None
        t = t[self.rows] if t.size(0) > 1 else t
        return t.expand(batch, -1)

    def candidates(self, batch: int, on_host: bool = False) -> dict[str, tuple[Tensor, Tensor]]:
        """Name -> (what the model saw on this shard, the same over the whole sequence), for padding
        (``key_valid``) and the documents (``documents``) the step's facts offer; ``on_host``: in host memory."""
        padding, position_ids, documents = (self._whole(t, batch) for t in (
            self.host if on_host else (self.padding, self.position_ids, self.documents)))
        local = self.positions if on_host else self.device_positions
        found = {}
        if padding is not None:
            found["padding"] = (padding[:, local].bool(), padding.bool())
        if position_ids is not None:  # what the model detects on its shard's ids, and on the whole ids
            found["position_ids"] = (packed_documents(position_ids[:, local]), packed_documents(position_ids))
        if documents is not None:
            found["documents"] = (documents[:, local], documents)
        return found

    def mask(self, reading: "Reading", batch: int, whole_length: int) -> SequenceMask:
        """The :class:`SequenceMask` over the whole sequences that ``reading`` of these facts gives, with its host
        twin; the parts that hide nothing dropped (:func:`simplest`)."""
        def made(found: dict[str, tuple[Tensor, Tensor]], host: Optional[SequenceMask] = None) -> SequenceMask:
            return SequenceMask(reading.causal, reading.window, found["padding"][1] if reading.padded else None,
                                found[reading.documents][1] if reading.documents else None, host)

        return simplest(made(self.candidates(batch), made(self.candidates(batch, on_host=True))), whole_length,
                        self.layout)


class Reading(NamedTuple):
    """Which facts a mask the model built on its shard is made of: causal order, a sliding window, the padding
    (when ``padded``) and the documents of candidate ``documents`` ("documents", "position_ids" or None)."""

    causal: bool
    window: Optional[int]
    padded: bool
    documents: Optional[str]


def _seen(mask: Tensor, length: int) -> Optional[tuple[Tensor, Tensor]]:
    """A boolean or additive attention mask as [B, 1, S, S] booleans (True: seen), and a device flag saying
    whether it is one (a bias that is not 0 or a large negative number, or heads that differ, are not); None
    for another shape or dtype."""
    if mask.dim() < 2 or mask.dim() > 4 or tuple(mask.shape[-2:]) != (length, length):
        return None
    if mask.dtype == torch.bool:
        seen, ok = mask, torch.ones((), dtype=torch.bool, device=mask.device)
    elif mask.is_floating_point():
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        seen, ok = ~hidden, (hidden | (mask == 0)).all()
    else:
        return None
    while seen.dim() < 4:  # broadcast as SDPA does: [S, S] and [H, S, S] align on the right
        seen = seen.unsqueeze(0)
    if seen.size(1) > 1:
        ok = ok & (seen == seen[:, :1]).all()
        seen = seen[:, :1]
    return seen, ok


def _readings(found: dict, layer: Optional[AttentionLayer], windows: tuple[int, ...]) -> Iterator[Reading]:
    """Every reading the facts offer, in the order tried. Where the shard cannot tell (no padded key, one
    document here), the facts the batch has apply: every rank then reads the mask the same way, as one process
    on the whole batch does."""
    causal_options = (layer.causal,) if layer is not None else (True, False)
    window_options = (layer.window,) if layer is not None else (*windows, None)
    document_options = [name for name in ("documents", "position_ids") if name in found] + [None]
    for options in itertools.product(causal_options, window_options, (True, False) if "padding" in found else
                                     (False,), document_options):
        yield Reading(*options)


def _agrees(seen: Tensor, found: dict, reading: Reading) -> Tensor:
    """A device flag: whether ``reading`` of the facts ``found`` gives the shard's mask ``seen``."""
    length = seen.size(-1)
    shard = torch.arange(length, device=seen.device)
    on_shard = SequenceMask(reading.causal, reading.window, found["padding"][0] if reading.padded else None,
                            found[reading.documents][0] if reading.documents else None)
    return (on_shard.between(shard, shard).expand_as(seen) == seen).all()


def explain(mask: Tensor, length: int, facts: SequenceFacts, layer: Optional[AttentionLayer],
            windows: tuple[int, ...]) -> Optional[Reading]:
    """The :class:`Reading` whose mask over the shard is ``mask`` (None: none explains it), found by reading
    the device. ``layer``: the attention module running, when known; ``windows``: the sliding windows the
    model's configs declare (tried when the layer is unknown)."""
    seen = _seen(mask, length)
    if seen is None or not bool(seen[1]):
        return None
    found = facts.candidates(seen[0].size(0))
    return next((reading for reading in _readings(found, layer, windows) if bool(_agrees(seen[0], found, reading))),
                None)


def agrees(mask: Tensor, length: int, facts: SequenceFacts, reading: Reading) -> Tensor:
    """A device flag, never read here: whether ``reading`` (what :func:`explain` found for an earlier mask of
    the same kind) still explains ``mask``."""
    seen = _seen(mask, length)
    if seen is None:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    return seen[1] & _agrees(seen[0], facts.candidates(seen[0].size(0)), reading)


def is_causal_mask(mask: Tensor, length: int) -> bool:
    """Whether ``mask`` is the plain lower-triangular mask of a ``length``-token self-attention.

    Boolean masks must be True exactly on and below the diagonal; additive masks 0 there and -inf (or the
    dtype's lowest value, which Hugging Face uses) above it.
    """
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    allowed = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.is_floating_point():
        return False
    return bool(torch.where(allowed, mask == 0, mask <= torch.finfo(mask.dtype).min).all())


class MaskReadings:
    """What each kind of mask a model builds (attention layer, dtype, rank, which facts the batch has) is made
    of. The first mask of a kind is explained by reading it; later ones are checked against that reading on the
    device (:func:`agrees`), and the flags go to host memory at the end of the forward (:meth:`stage`, on CUDA
    pinned and behind an event) and are read at the next batch (:meth:`read`): a step's host never waits for
    its masks. ``windows``: the sliding windows the model's configs declare; ``document_key``: cp_document_key."""

    def __init__(self, windows: tuple[int, ...], document_key: Optional[str]) -> None:
        self.windows, self.document_key = windows, document_key
        self._readings: dict[tuple, Reading] = {}
        self._checks: list[tuple[Tensor, tuple]] = []  # this step's device flags, with the kind each checks
        self._staged: list[tuple[Tensor, Optional[Any], list[tuple]]] = []  # (flags, CUDA event or None, kinds)

    def of(self, mask: Tensor, length: int, facts: SequenceFacts, layer: Optional[AttentionLayer]) -> Reading:
        """The reading of ``mask``, a [.., length, length] mask built on a shard."""
        kind = (layer, mask.dtype, mask.dim(), facts.kinds)
        reading = self._readings.get(kind)
        if reading is None:
            reading = self._readings[kind] = self._explain(mask, length, facts, layer)
        else:
            self._checks.append((agrees(mask, length, facts, reading), kind))
        return reading

    def _explain(self, mask: Tensor, length: int, facts: SequenceFacts, layer: Optional[AttentionLayer]) -> Reading:
        windowed = layer is not None and layer.window is not None
        if facts.empty and not windowed and is_causal_mask(mask, length):
            return Reading(True, None, False, None)
        # a shard without padding (or whose window spans it) can look causal: the facts decide
        found = explain(mask, length, facts, layer, self.windows)
        if found is None:
            raise ValueError(
                f"scaled_dot_product_attention got an attn_mask of shape {tuple(mask.shape)}"
                f" ({mask.dtype}) that context parallelism cannot carry over to the whole sequence: no"
                " combination of causal order, the layer's sliding window, the batch's padding"
                " ('attention_mask'), packed documents (restarting 'position_ids', or the document ids named"
                f" by cp_document_key={self.document_key!r}) gives that mask on this rank's shard. A bias or a"
                " pattern of the model's own has no meaning on a shard: use cp=1, or pass the padding or"
                " document ids the mask comes from in the batch under those names.")
        return found

    def stage(self) -> None:
        """This step's mask checks on their way to host memory (on CUDA: pinned, behind an event)."""
        if not self._checks:
            return
        flags, kinds = torch.stack([flag for flag, _ in self._checks]), [kind for _, kind in self._checks]
        self._checks = []
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        self._staged.append((flags, event, kinds))

    def read(self) -> None:
        """Raise if a staged check failed: a mask of a kind explained before is no longer what its reading says
        (the model built it from other facts). It waits at most for the device to finish the forward that made
        the flags, a step back."""
        staged, self._staged = self._staged, []
        for flags, event, kinds in staged:
            if event is not None:
                event.synchronize()
            failed = [kind for kind, ok in zip(kinds, flags.tolist()) if not ok]
            if failed:
                reading = self._readings.pop(failed[0])
                layer, dtype, dims, _ = failed[0]
                used = ([f"causal order{f' with a window of {reading.window}' if reading.window else ''}"]
                        if reading.causal else []) + (["the batch's padding ('attention_mask')"] if reading.padded
                                                      else [])
                source = "restarting 'position_ids'" if reading.documents == "position_ids" else repr(self.document_key)
                used += [f"its documents ({source})"] if reading.documents else []
                raise ValueError(
                    f"Context parallelism read the {dims}-d {dtype} attention masks of"
                    f" {layer or 'an attention call'} the first time as made of {', '.join(used) or 'nothing'}, and"
                    " checks every later one against that on the device: the mask of the last step is not made of"
                    " those, so that step's attention differs from what one process computes. The model leaves"
                    " out a fact the batch offers, which its first batch could not show: leave it out of the batch"
                    " too (the tensor named above), or use cp=1.")


def simplest(mask: SequenceMask, length: int, layout: Optional[SequenceLayout] = None) -> SequenceMask:
    """``mask`` without the parts that hide nothing: a window as long as the sequence, padding with every key
    valid, one document per row (decided on its host twin); over shards in ``layout``."""
    window = mask.window if mask.window is not None and mask.window < length else None
    host = mask.on_host()
    pads, splits = host.pads(), host.splits_documents()
    twin = SequenceMask(mask.causal, window, host.key_valid if pads else None, host.documents if splits else None)
    return SequenceMask(mask.causal, window, mask.key_valid if pads else None, mask.documents if splits else None,
                        twin, layout=layout)


def unmasked(is_causal: bool, facts: SequenceFacts, layer: Optional[AttentionLayer], batch: int,
             whole_length: int, recomputing: bool = False) -> Optional[SequenceMask]:
    """What a Hugging Face attention layer's call without a mask means for the whole sequence: Hugging Face
    leaves the mask out where it hides nothing on the tokens it sees (a shard without padding, a window as
    long as the shard), so the batch's padding and the layer's window still apply. None: plain causal or full
    attention (also for any other module: its call means what it says). ``recomputing``: the call runs again
    during backward (activation checkpointing)."""
    if layer is None:
        return None
    if recomputing and facts.pipelined and facts.host[0] is not None and not bool(facts.host[0].bool().all()):
        raise ValueError(
            "A Hugging Face attention layer recomputed during backward (activation checkpointing) under pipeline"
            " and context parallelism called attention without a mask on a padded batch: its shard held no"
            " padding, but other shards' keys may, and which micro-batch it recomputes is not known there. Use"
            " activation_checkpointing='none' with pp and cp on padded batches, pack the samples without padding"
            " (position_ids restarting at 0), or use pp=1.")
    mask = facts.mask(Reading(is_causal, layer.window if is_causal else None, facts.padding is not None, None),
                      batch, whole_length)
    return None if mask.window is None and mask.key_valid is None else mask
