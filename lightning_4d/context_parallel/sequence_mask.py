"""Which keys each query sees, in global terms over the whole sequences: causal order, a sliding window, key
padding, packed documents. Small (one number per token), held alike by every cp rank, so ring attention and
Ulysses compute a tile pair's mask where it is needed and nothing extra travels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_4d.context_parallel.document_layout import SequenceLayout

__all__ = ["SequenceMask", "check_mask"]


@dataclass(frozen=True)
class SequenceMask:
    """Which keys each query sees, in global terms over the whole sequences (the same on every cp rank).

    ``causal``: keys at later positions are hidden. ``window``: keys ``window`` or more positions before the
    query are hidden too (Hugging Face's sliding window: a query at ``q`` sees ``q - window < k <= q``).
    ``key_valid`` ([B, L] bool): padding keys are hidden. ``documents`` ([B, L] integers): keys of another
    document than the query's are hidden (packed sequences). ``layout``: the positions each rank holds
    (:class:`~.document_layout.SequenceLayout`); None: the zigzag layout. ``host``: the same mask over host-memory
    copies of ``key_valid`` and ``documents`` (made from the batch as the data loader gave it), on which the host
    decides what to compute without reading the device.
    """

    causal: bool = True
    window: Optional[int] = None
    key_valid: Optional[torch.Tensor] = None
    documents: Optional[torch.Tensor] = None
    host: Optional["SequenceMask"] = field(default=None, compare=False, repr=False)
    # what :meth:`seen_in` answered, by the caller's key: a step's layers ask about the same tiles
    answers: dict = field(default_factory=dict, compare=False, repr=False)
    layout: Optional[SequenceLayout] = field(default=None, compare=False)

    def on_host(self) -> "SequenceMask":
        """This mask over host memory: its twin, itself when its tensors are there already, or else a copy (a
        read of the device: masks built outside a step's batch, once per call)."""
        if self.host is not None:
            return self.host
        if all(t is None or t.device.type == "cpu" for t in (self.key_valid, self.documents)):
            return self
        return SequenceMask(self.causal, self.window, *(t if t is None else t.cpu() for t in (self.key_valid,
                                                                                            self.documents)),
                            layout=self.layout)

    def seen_in(self, q_pos: torch.Tensor, k_pos: torch.Tensor, key: Any) -> tuple[bool, bool]:
        """Whether any query of ``q_pos`` sees a key of ``k_pos``, and whether every one sees every one, once per
        ``key`` (naming the positions). Read on the host: call it on :meth:`on_host`'s mask with host positions."""
        if key not in self.answers:
            seen = self.between(q_pos, k_pos)
            self.answers[key] = (bool(seen.any()), bool(seen.all()))
        return self.answers[key]

    def pads(self) -> bool:
        """Whether a padding key is hidden anywhere. Read on the host, as :meth:`seen_in`."""
        return self.key_valid is not None and not bool(self.key_valid.all())

    def splits_documents(self) -> bool:
        """Whether a row holds more than one document. Read on the host, as :meth:`seen_in`."""
        return self.documents is not None and not bool((self.documents == self.documents[:, :1]).all())

    def between(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[B or 1, 1, len(q_pos), len(k_pos)] bool: whether each query sees each key."""
        seen = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
        if self.causal:
            seen &= k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        if self.window is not None:
            seen &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.window
        seen = seen[None, None]
        if self.key_valid is not None:
            seen = seen & self.key_valid[:, k_pos][:, None, None, :]
        if self.documents is not None:
            seen = seen & (self.documents[:, q_pos].unsqueeze(-1) == self.documents[:, k_pos].unsqueeze(-2)).unsqueeze(1)
        return seen


def check_mask(mask: SequenceMask, q: torch.Tensor, cp: int) -> None:
    """``mask`` fits local queries ``q`` [B, H, S, D] of a sequence split over ``cp`` ranks (in its layout)."""
    if mask.layout is not None:
        if tuple(mask.layout.positions.shape) != (cp, q.size(2)):
            raise ValueError(f"SequenceMask.layout holds {tuple(mask.layout.positions.shape)} positions (ranks, tokens"
                             f" each), but the queries are {q.size(2)} tokens on each of cp={cp} ranks")
    elif q.size(2) % 2:
        raise ValueError(f"local sequence length {q.size(2)} is odd, but a SequenceMask needs the zigzag layout (two"
                         " equal chunks per rank); make the global length a multiple of 2*cp")
    if mask.window is not None and mask.window < 1:
        raise ValueError(f"SequenceMask.window={mask.window}: a window holds at least the query itself (>= 1)")
    for name in ("key_valid", "documents"):
        t = getattr(mask, name)
        if t is not None and (t.dim() != 2 or t.size(0) != q.size(0) or t.size(1) != q.size(2) * cp):
            raise ValueError(f"SequenceMask.{name} must be [batch, whole sequence] = [{q.size(0)}, {q.size(2) * cp}],"
                             f" got {tuple(t.shape)}")
