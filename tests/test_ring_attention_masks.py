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

import pytest
import torch
import torch.nn.functional as F

from lightning_4d.context_parallel.apply import ContextParallel
from lightning_4d.context_parallel.document_layout import MASKED_COST, WHOLE_COST, balanced_layout
from lightning_4d.context_parallel.ring_attention import ring_attention
from lightning_4d.context_parallel.sequence_mask import SequenceMask
from lightning_4d.context_parallel.zigzag import shard_sequence, zigzag_positions
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
    balanced: bool = False  # shards in the document-balanced layout of the mask's documents, not the zigzag

    @property
    def name(self) -> str:
        return (f"{self.grouping}-cp{self.cp}-{self.comm}-{self.kind}-L{self.seq_len}-q{self.hq}kv{self.hkv}"
                f"-{self.kernel}" + ("-balanced" if self.balanced else ""))


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
    for kind in ("documents", "causal", "padding+documents", "window+documents"):  # the document-balanced layout
        for comm in ("ring", "allgather", "a2a"):
            cases.append(Case("world", 4, comm, kind, 64, hq=8, hkv=4, balanced=True))
        cases.append(Case("pairs", 2, "ring", kind, 48, balanced=True))
    cases.append(Case("pairs", 2, "ring", "documents", 48, hkv=4, kernel="math", balanced=True))
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
    if case.balanced:  # laid out for documents the mask may leave to the model (plain causal calls on packed rows)
        starts = torch.rand(BATCH, length, generator=gen) < 0.1
        starts[:, 0] = True
        packed = starts.long().cumsum(1) if documents is None else documents
        return SequenceMask(causal=True, window=window, key_valid=key_valid,
                            documents=None if case.kind == "causal" else packed,
                            layout=balanced_layout(packed, case.cp))
    if case.kind in ("causal", "bidirectional"):
        return None
    return SequenceMask(causal="bidirectional" not in case.kind, window=window, key_valid=key_valid,
                        documents=documents)


def _run_case(case: Case, group, cp_rank: int, group_id: int) -> dict:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + group_id)
    mask = _mask(case, gen)
    length, hq = case.seq_len, case.hq
    causal = case.kind == "causal" and mask is None

    def full(heads):
        return torch.randn(BATCH, heads, length, HEAD_DIM, generator=gen).double()

    ref_inputs = [full(hq).requires_grad_(), full(case.hkv).requires_grad_(), full(case.hkv).requires_grad_()]
    dout = full(hq)
    dense = mask.between(torch.arange(length), torch.arange(length)) if mask is not None else None
    ref_out = F.scaled_dot_product_attention(*ref_inputs, attn_mask=dense, is_causal=causal, enable_gqa=True)
    ref_out.backward(dout)
    refs = [ref_out.detach()] + [t.grad for t in ref_inputs]

    if mask is not None and mask.layout is not None:
        def shard(t, *_):
            return t.index_select(2, mask.layout.of(cp_rank))
    else:
        shard = shard_sequence
    q, k, v = (shard(t.detach(), 2, case.cp, cp_rank).float().requires_grad_() for t in ref_inputs)
    if case.comm == "a2a":
        out = ulysses_attention(q, k, v, group=group, is_causal=causal, mask=mask)
    elif case.kernel == "math":
        out = ring._RingAttention.apply(q, k, v, group, False, HEAD_DIM ** -0.5, case.comm, ring._MathKernel(), mask)
    else:
        out = ring_attention(q, k, v, group=group, comm=case.comm, mask=mask)
    out.backward(shard(dout, 2, case.cp, cp_rank).float())
    errors = {}
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), refs):
        errors[name] = (got.double() - shard(ref, 2, case.cp, cp_rank)).abs().max().item()
    return errors


def _chosen_positions(group) -> dict:
    """The global positions :class:`ContextParallel` gives this rank of batches packed with documents (position ids
    restarting; document ids named by ``cp_document_key``) and of an unpacked one."""
    documents = _packed(64, 2, 24).repeat(2, 1)
    starts = torch.where(torch.diff(documents, prepend=documents[:, :1] - 1) != 0, torch.arange(64), 0)
    tokens = torch.arange(64).repeat(2, 1)  # token i is i: a shard's tokens are its positions
    restarting = torch.arange(64) - starts.cummax(-1).values
    batches = {"position_ids": (None, {"input_ids": tokens, "position_ids": restarting}),
               "document_key": ("document_ids", {"input_ids": tokens, "document_ids": documents}),
               "unpacked": (None, {"input_ids": tokens, "position_ids": torch.arange(64).expand(2, -1)})}
    chosen = {}
    for name, (document_key, batch) in batches.items():
        context = ContextParallel(torch.nn.Linear(4, 4), group, document_key=document_key)
        shard = context.shard_batch(batch)
        chosen[name] = [shard["input_ids"][0].tolist(), context.local_positions(batch).tolist()]
        context.remove()
    return chosen


def run_mask_cases(groups: dict) -> dict:
    """Every case on this rank, in the launch of tests/test_ring_attention.py (its cp groups: name -> (group,
    rank in it, index of the group)), and the layouts chosen for packed batches."""
    results = {}
    for case in _cases():
        group, cp_rank, group_id = groups[case.grouping]
        results[case.name] = _run_case(case, group, cp_rank, group_id)
    for grouping in ("world", "pairs"):
        results[f"chosen-{grouping}"] = _chosen_positions(groups[grouping][0])
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
        per_token = [sum(ring.tile_work(SequenceMask(window=window), length, cp, rank)) / (length // cp)
                     for length in lengths]
        causal = [sum(ring.tile_work(SequenceMask(), length, cp, rank)) / (length // cp) for length in lengths]
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


def _packed(length: int, shortest: int, longest: int) -> torch.Tensor:
    """[1, length] document ids: lengths drawn from ``shortest`` to ``longest`` tokens, seeded (bench/cp.py's)."""
    generator, lengths = torch.Generator().manual_seed(0), []
    while sum(lengths) < length:
        drawn = int(torch.randint(shortest, longest + 1, (1,), generator=generator))
        lengths.append(min(drawn, length - sum(lengths)))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)


def _cost(mask: SequenceMask, length: int, cp: int) -> list[int]:
    """Each rank's attention work under ``mask``: its tile pairs' elements, a masked pair at the cost the layout
    weighs it with."""
    return [WHOLE_COST * whole + MASKED_COST * masked
            for whole, masked in (ring.tile_work(mask, length, cp, rank) for rank in range(cp))]


@pytest.mark.parametrize("cp", [2, 4])
def test_document_balanced_layout_evens_the_work_the_zigzag_does_not(cp):
    """8,192 tokens of documents of 64 to 4,096 tokens (docs/context_parallel.md's case): the attention the ring
    computes per rank, counted over its own tile pairs, is within 5% between the busiest and the idlest rank in the
    document-balanced layout, where the zigzag's is 8% (cp=2) and 63% (cp=4) apart; and the busiest rank does less
    than under the zigzag."""
    length, documents = 8192, _packed(8192, 64, 4096)
    zigzag = _cost(SequenceMask(causal=True, documents=documents), length, cp)
    balanced = _cost(SequenceMask(causal=True, documents=documents, layout=balanced_layout(documents, cp)), length, cp)
    assert max(zigzag) > 1.05 * min(zigzag), zigzag  # the case is one the zigzag leaves unbalanced
    assert max(balanced) <= 1.05 * min(balanced), balanced
    assert max(balanced) < max(zigzag), (balanced, zigzag)


@pytest.mark.parametrize("grouping, cp", [("world", 4), ("pairs", 2)])
def test_context_parallel_lays_out_packed_batches_for_documents(grouping, cp, dist_results):
    """A batch whose position ids restart, or whose document ids cp_document_key names, is sharded in the
    document-balanced layout of its documents; an unpacked one keeps the zigzag."""
    documents = _packed(64, 2, 24).repeat(2, 1)
    for rank, per_rank in enumerate(dist_results):
        cp_rank = rank % cp  # pairs: ranks 0, 1 and 2, 3
        chosen = per_rank[f"chosen-{grouping}"]
        balanced = balanced_layout(documents, cp).positions[cp_rank].tolist()
        assert balanced != zigzag_positions(64, cp, cp_rank).tolist()
        assert chosen["position_ids"] == [balanced, balanced], (rank, chosen)
        assert chosen["document_key"] == [balanced, balanced], (rank, chosen)
        assert chosen["unpacked"] == [zigzag_positions(64, cp, cp_rank).tolist()] * 2, (rank, chosen)


def test_document_balanced_layout_partitions_the_sequence_in_increasing_runs():
    documents = _packed(96, 2, 40).expand(3, -1).clone()
    documents[1] = torch.arange(96) // 7  # rows packed differently: the layout serves the batch
    for cp, pieces in ((2, None), (4, 2), (3, 4)):
        layout = balanced_layout(documents, cp, pieces)
        assert sorted(layout.positions.flatten().tolist()) == list(range(96))
        runs = layout.positions.view(cp, layout.pieces, -1)
        assert bool((runs.diff(dim=-1) == 1).all()) and bool((layout.positions.diff(dim=-1) > 0).all())
    with pytest.raises(ValueError, match="pieces=5 does not divide a rank's 48 tokens"):
        balanced_layout(documents, 2, 5)
