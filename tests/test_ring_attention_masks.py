"""Ring attention under masks beyond causal and full attention (issue #29): padding, sliding windows, packed
documents and their combinations, as a :class:`~lightning_4d.context_parallel.sequence_mask.SequenceMask`; and
Ulysses attention (``cp_comm='a2a'``) with the same masks and grouped heads.

The 4-process launch of tests/test_ring_attention.py (cp groups of 4 and of 2 carved out of it) runs every
case: each rank's output and gradients against fp64 ``F.scaled_dot_product_attention`` over the whole sequence
with the same mask written out densely, within 1e-5. The launch also counts the tile pairs each rank computes
under a sliding window as the sequence grows: the count must stay flat past the window (skipped tiles), which
fails if the mask were applied to every tile.
"""

from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from lightning_4d.context_parallel.ring_attention import ring_attention
from lightning_4d.context_parallel.sequence_mask import SequenceMask
from lightning_4d.context_parallel.zigzag import shard_sequence
from lightning_4d.context_parallel.ulysses import ulysses_attention
from tests.test_ring_attention import dist_results  # noqa: F401  (a session fixture: one launch for both files)

TOL = 1e-5
BATCH, HEAD_DIM = 2, 8
ring = importlib.import_module("lightning_4d.context_parallel.ring_attention")  # the module, not the function


@dataclass(frozen=True)
class Case:
    grouping: str
    cp: int
    comm: str  # ring, allgather, or a2a (Ulysses)
    kind: str  # padding, window, documents, padding+documents, window+padding, bidirectional+padding, causal, ...
    seq_len: int
    hkv: int = 2
    kernel: str = "auto"
    hq: int = 4

    @property
    def name(self) -> str:
        return (f"{self.grouping}-cp{self.cp}-{self.comm}-{self.kind}-L{self.seq_len}-q{self.hq}kv{self.hkv}"
                f"-{self.kernel}")


KINDS = ("padding", "window", "documents", "padding+documents", "window+padding", "window+documents",
         "bidirectional+padding", "bidirectional+documents")


def _cases() -> list[Case]:
    cases = []
    for comm in ("ring", "allgather"):
        for kind in KINDS:
            cases.append(Case("world", 4, comm, kind, 32))
            cases.append(Case("pairs", 2, comm, kind, 24))
        cases.append(Case("pairs", 2, comm, "padding+documents", 16, hkv=4, kernel="math"))
        cases.append(Case("world", 4, comm, "window", 32, hkv=1, kernel="math"))
    for kind in ("causal", "bidirectional", "padding", "window+padding", "documents"):  # Ulysses
        cases.append(Case("world", 4, "a2a", kind, 32, hq=8, hkv=4))
        cases.append(Case("pairs", 2, "a2a", kind, 24, hq=4, hkv=2))
    return cases


def _mask(case: Case, gen: torch.Generator) -> SequenceMask:
    """A random mask of the case's kind over [BATCH, seq_len]: right padding, documents of unequal lengths."""
    length = case.seq_len
    key_valid = documents = window = None
    if "padding" in case.kind:
        lengths = torch.randint(length // 3, length + 1, (BATCH,), generator=gen)
        key_valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if "documents" in case.kind:
        starts = torch.rand(BATCH, length, generator=gen) < 0.2
        starts[:, 0] = True
        documents = starts.long().cumsum(1)
    if "window" in case.kind:
        window = length // 4
    if case.kind in ("causal", "bidirectional"):
        return None
    return SequenceMask(causal="bidirectional" not in case.kind, window=window, key_valid=key_valid,
                        documents=documents)


def _run_case(case: Case, group, cp_rank: int, group_id: int) -> dict:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + group_id)
    mask = _mask(case, gen)
    length, hq = case.seq_len, case.hq
    causal = case.kind == "causal"

    def full(heads):
        return torch.randn(BATCH, heads, length, HEAD_DIM, generator=gen).double()

    ref_inputs = [full(hq).requires_grad_(), full(case.hkv).requires_grad_(), full(case.hkv).requires_grad_()]
    dout = full(hq)
    dense = mask.between(torch.arange(length), torch.arange(length)) if mask is not None else None
    ref_out = F.scaled_dot_product_attention(*ref_inputs, attn_mask=dense, is_causal=causal, enable_gqa=True)
    ref_out.backward(dout)
    refs = [ref_out.detach()] + [t.grad for t in ref_inputs]

    q, k, v = (shard_sequence(t.detach(), 2, case.cp, cp_rank).float().requires_grad_() for t in ref_inputs)
    if case.comm == "a2a":
        out = ulysses_attention(q, k, v, group=group, is_causal=causal, mask=mask)
    elif case.kernel == "math":
        out = ring._RingAttention.apply(q, k, v, group, False, HEAD_DIM ** -0.5, case.comm, ring._MathKernel(), mask)
    else:
        out = ring_attention(q, k, v, group=group, comm=case.comm, mask=mask)
    out.backward(shard_sequence(dout, 2, case.cp, cp_rank).float())
    errors = {}
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), refs):
        errors[name] = (got.double() - shard_sequence(ref, 2, case.cp, cp_rank)).abs().max().item()
    return errors


def _work(length: int, cp: int, rank: int, window: Optional[int]) -> int:
    """Query x key elements of the tile pairs one rank computes for one causal sequence of ``length``."""
    tiles = ring._tile_rows(length // cp, window)
    mask = SequenceMask(causal=True, window=window)
    return sum((tiles[i].stop - tiles[i].start) * (tiles[j].stop - tiles[j].start)
               for owner in range(cp) for j in range(len(tiles))
               for i, _, _ in ring._pairs(rank, owner, j, tiles, cp, False, mask))


def run_mask_cases(groups: dict) -> dict:
    """Every case on this rank, in the launch of tests/test_ring_attention.py (its cp groups: name -> (group,
    rank in it, index of the group))."""
    results = {}
    for case in _cases():
        group, cp_rank, group_id = groups[case.grouping]
        results[case.name] = _run_case(case, group, cp_rank, group_id)
    return results


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_masked_ring_attention_matches_full_attention(case, dist_results):
    for rank, per_rank in enumerate(dist_results):
        for name, error in per_rank[case.name].items():
            assert error <= TOL, f"{case.name} rank {rank}: {name} max abs error {error:.3g} > {TOL}"


@pytest.mark.parametrize("cp", [2, 4])
def test_sliding_window_work_per_token_stays_flat_as_the_sequence_grows(cp):
    """Attention elements computed per rank and query token with a 64-token window, from 4x to 16x the window:
    bounded by two windows whatever the length (tiles outside the window skipped, tiles no longer than the
    window; a token's own window costs one), where causal attention alone grows with the length."""
    window, lengths = 64, (4 * 64, 8 * 64, 16 * 64)
    for rank in range(cp):
        per_token = [_work(length, cp, rank, window) / (length // cp) for length in lengths]
        causal = [_work(length, cp, rank, None) / (length // cp) for length in lengths]
        assert all(window / 2 <= work <= 2 * window for work in per_token), per_token
        assert causal[2] >= 3.5 * causal[0] and causal[2] > 4 * per_token[2], causal


def test_bad_masks_are_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="either is_causal=True or a SequenceMask"):
        ring_attention(q, q, q, group=None, is_causal=True, mask=SequenceMask())



def test_ulysses_refuses_heads_cp_does_not_divide():
    from lightning_4d.context_parallel.ulysses import check_heads

    with pytest.raises(ValueError, match=r"cp_comm='a2a' .* has 2 key/value heads .* cp_comm='ring'"):
        check_heads(8, 2, 4, "model.layers.0 (LlamaAttention)")
