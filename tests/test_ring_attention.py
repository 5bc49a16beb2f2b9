"""Tests for lightning_4d.context_parallel.ring_attention.

The distributed cases run on CPU/gloo. Process start-up dominates on small machines, so
one 4-process world is launched once, cp groups of size 4, 2 and 1 are carved out of it,
and every rank loops over all cases, writing max errors to a JSON file per rank; the
parent then asserts per case. The same launch measures the peak memory of one cp=4 ring
call the way bench/cp.py does. A launch that does not finish within LAUNCH_TIMEOUT_S is
killed and fails (a hang must not block the suite).
"""

from __future__ import annotations

import json
import math
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.cp import LiveStorage
from lightning_4d.context_parallel.ring_attention import (
    _CpuFlashKernel,
    _MathKernel,
    _RingAttention,
    ring_attention,
)
from lightning_4d.context_parallel.zigzag import shard_sequence, unshard_sequence, zigzag_positions
from tests.parity import spawn

LAUNCH_TIMEOUT_S = 150
FP32_TOL = 1e-5
# bf16 results vs. an fp64 reference on the same bf16-rounded inputs, relative to max |ref|.
BF16_REL_TOL = 2e-2
BATCH, HEAD_DIM = 2, 16

WORLD = 4
# Peak live tensor storage per rank of one causal cp=4 ring forward+backward, in blocks of one rank's
# q ([1, 4, MEMORY_SEQ, HEAD_DIM] fp32): q, k, v, output gradient, output and dq (6); K/V tiles and
# dK/dV partial-sum tiles in flight, 5 quarter-block tiles of K+V each (2 x 2 x 5/4); the gradients
# of one tile pair (3/4); the log-sum-exp (1/HEAD_DIM). Whole-block double buffering measured 19.5.
MEMORY_SEQ = 64
MEMORY_BLOCKS = 6 + 2 * 2 * 5 / 4 + 3 / 4 + 1 / HEAD_DIM
# cp groups carved out of the one launched world: name -> rank lists (None: the whole world).
GROUPINGS = {
    "world": None,
    "pairs": [[0, 1], [2, 3]],
    "strided": [[0, 2], [1, 3]],
    "solo": [[0], [1], [2], [3]],
}


@dataclass(frozen=True)
class Case:
    grouping: str
    cp: int
    comm: str
    causal: bool
    hq: int
    hkv: int
    seq_len: int
    dtype: str = "float32"
    kernel: str = "auto"  # "math": force the fallback kernel used on CUDA when nothing fused fits
    layout: str = "zigzag"  # "contiguous": plain chunks, valid without causal masking

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"{self.grouping}-cp{self.cp}-{self.comm}-{mask}-h{self.hq}kv{self.hkv}-L{self.seq_len}"
            f"-{self.dtype}-{self.kernel}-{self.layout}"
        )


def _cases() -> list[Case]:
    cases = []
    for comm in ("ring", "allgather"):
        for causal in (False, True):
            for hq, hkv in ((4, 4), (4, 2), (4, 1)):
                cases += [Case("world", 4, comm, causal, hq, hkv, n) for n in (8, 24)]
                cases += [Case("pairs", 2, comm, causal, hq, hkv, n) for n in (4, 12)]
            for grouping, cp in (("world", 4), ("pairs", 2)):
                cases.append(Case(grouping, cp, comm, causal, 4, 2, 4 * cp, dtype="bfloat16"))
                cases.append(Case(grouping, cp, comm, causal, 4, 2, 4 * cp, kernel="math"))
            cases.append(Case("strided", 2, comm, causal, 4, 2, 8))
            cases.append(Case("solo", 1, comm, causal, 4, 2, 8))
        cases.append(Case("pairs", 2, comm, False, 4, 2, 6, layout="contiguous"))
    return cases


def _shard(t: torch.Tensor, case: Case, cp_rank: int) -> torch.Tensor:
    if case.layout == "contiguous":
        return t.chunk(case.cp, dim=2)[cp_rank]
    return shard_sequence(t, 2, case.cp, cp_rank)


def _run_case(case: Case, group, cp_rank: int, group_id: int) -> dict:
    """Max |error| of out, dq, dk, dv on this rank vs. full fp64 SDPA over the whole sequence."""
    dtype = getattr(torch, case.dtype)
    # Same data on every rank of a group; different groups get different data.
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + group_id)

    def full(heads):
        return torch.randn(BATCH, heads, case.seq_len, HEAD_DIM, generator=gen).to(dtype).double()

    ref_inputs = [full(case.hq).requires_grad_(), full(case.hkv).requires_grad_(), full(case.hkv).requires_grad_()]
    dout = full(case.hq)
    ref_out = F.scaled_dot_product_attention(*ref_inputs, is_causal=case.causal, enable_gqa=True)
    ref_out.backward(dout)
    refs = [ref_out.detach()] + [t.grad for t in ref_inputs]

    q, k, v = (_shard(t.detach(), case, cp_rank).to(dtype).requires_grad_() for t in ref_inputs)
    if case.kernel == "math":
        out = _RingAttention.apply(q, k, v, group, case.causal, 1 / math.sqrt(HEAD_DIM), case.comm, _MathKernel())
    else:
        out = ring_attention(q, k, v, group=group, is_causal=case.causal, comm=case.comm)
    out.backward(_shard(dout, case, cp_rank).to(dtype))

    errors = {}
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), refs):
        local_ref = _shard(ref, case, cp_rank)
        errors[name] = {
            "abs": (got.double() - local_ref).abs().max().item(),
            "scale": local_ref.abs().max().item(),
            "dtype_ok": got.dtype == dtype,
        }
    return errors


def _peak_blocks(group) -> float:
    """Peak tensor storage of one causal ring forward+backward, inputs and gradients included, in q blocks."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    shape = (1, 4, MEMORY_SEQ, HEAD_DIM)
    with LiveStorage() as memory:
        q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        ring_attention(q, k, v, group=group, is_causal=True).backward(dout)
    return memory.peak / (math.prod(shape) * 4)


def _worker(rank: int, world: int, result_dir: str) -> None:
    torch.set_num_threads(1)
    results: dict = {}
    try:
        init_method = f"file://{Path(result_dir, 'init')}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        groups = {}
        for grouping, layout in GROUPINGS.items():
            if layout is None:
                groups[grouping] = (dist.group.WORLD, rank, 0)
                continue
            for group_id, ranks in enumerate(layout):
                group = dist.new_group(ranks)  # every rank must create every group
                if rank in ranks:
                    groups[grouping] = (group, ranks.index(rank), group_id)
        for case in _cases():
            group, cp_rank, group_id = groups[case.grouping]
            results[case.name] = _run_case(case, group, cp_rank, group_id)
        results["__peak_blocks__"] = _peak_blocks(dist.group.WORLD)
        from tests.test_ring_attention_masks import run_mask_cases  # the same launch serves the masked cases

        results.update(run_mask_cases(groups))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results["__error__"] = traceback.format_exc()
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="session")
def dist_results():
    """One 4-process launch serves every distributed case (cp=4, two kinds of cp=2, cp=1), those of
    tests/test_ring_attention_masks.py included."""
    results = spawn(_worker, WORLD, LAUNCH_TIMEOUT_S)
    for rank, data in enumerate(results):
        if "__error__" in data:
            pytest.fail(f"rank {rank} raised:\n{data['__error__']}")
    return results


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_matches_full_attention(case, dist_results):
    for rank, per_rank in enumerate(dist_results):
        for name, e in per_rank[case.name].items():
            tol = FP32_TOL if case.dtype == "float32" else BF16_REL_TOL * max(1.0, e["scale"])
            assert e["dtype_ok"], f"{case.name} rank {rank}: {name} has the wrong dtype"
            assert e["abs"] <= tol, f"{case.name} rank {rank}: {name} max abs error {e['abs']:.3g} > {tol:.3g}"


def test_ring_peak_memory(dist_results):
    """Tiles in flight, not whole double-buffered blocks: the cp=4 peak that bench/cp.py reports at 16k tokens."""
    for rank, per_rank in enumerate(dist_results):
        assert per_rank["__peak_blocks__"] <= MEMORY_BLOCKS, (
            f"rank {rank}: peak {per_rank['__peak_blocks__']:.3f} blocks > {MEMORY_BLOCKS:.3f}"
        )


# --------------------------------------------------------------------------- single process


def test_zigzag_positions_layout():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(6, 1, 0).tolist() == list(range(6))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions_partition_sequence(cp):
    seq_len = 2 * cp * 3
    per_rank = [zigzag_positions(seq_len, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(per_rank).sort().values, torch.arange(seq_len))
    for positions in per_rank:
        assert positions.numel() == seq_len // cp
        assert bool((positions.diff() > 0).all()), "local order must follow global order"


def test_shard_and_unshard_roundtrip():
    t = torch.arange(2 * 12 * 3).view(2, 12, 3)
    shards = [shard_sequence(t, 1, 3, r) for r in range(3)]
    assert torch.equal(shards[1], t.index_select(1, zigzag_positions(12, 3, 1)))
    assert torch.equal(unshard_sequence(shards, 1), t)


def test_zigzag_rejects_bad_rank_and_size():
    with pytest.raises(ValueError, match="cp_rank must be in"):
        zigzag_positions(8, 2, 2)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        zigzag_positions(8, 0, 0)


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("q", "k", "v", "kwargs", "pattern"),
    [
        (_t(1, 3, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8), {}, r"query heads \(3\).*key/value heads \(2\)"),
        (_t(1, 4, 4, 8), _t(1, 2, 4, 8), _t(1, 1, 4, 8), {}, "k and v must have the same shape"),
        (_t(1, 4, 4, 8), _t(1, 2, 6, 8), _t(1, 2, 6, 8), {}, "must agree on batch, local sequence"),
        (_t(1, 4, 8), _t(1, 4, 8), _t(1, 4, 8), {}, r"q must be \[batch, heads, seq, head_dim\]"),
        (_t(1, 4, 4, 8), _t(1, 4, 4, 8), _t(1, 4, 4, 8), {"comm": "tree"}, "unknown comm mode 'tree'"),
        (_t(1, 4, 3, 8), _t(1, 4, 3, 8), _t(1, 4, 3, 8), {"is_causal": True}, "local sequence length 3 is odd"),
        (
            _t(1, 4, 4, 8),
            _t(1, 4, 4, 8, dtype=torch.bfloat16),
            _t(1, 4, 4, 8),
            {},
            "must share dtype and device",
        ),
    ],
)
def test_ring_attention_rejects_bad_inputs(q, k, v, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ring_attention(q, k, v, group=None, **kwargs)


@pytest.mark.parametrize(("causal", "sq", "sk"), [(False, 4, 8), (False, 8, 4), (True, 6, 6)])
def test_math_kernel_matches_cpu_flash(causal, sq, sk):
    """The CUDA fallback kernel must agree with the fused CPU one, including GQA and lse."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, sq, 16, generator=gen)
    k, v = (torch.randn(2, 2, sk, 16, generator=gen) for _ in range(2))
    dout = torch.randn(2, 4, sq, 16, generator=gen)
    scale = 0.3
    flash, math_kernel = _CpuFlashKernel(), _MathKernel()
    out, lse, _ = flash.forward(q, k, v, causal, scale)
    m_out, m_lse, _ = math_kernel.forward(q, k, v, causal, scale)
    torch.testing.assert_close(m_out, out, atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(m_lse, lse, atol=FP32_TOL, rtol=0)
    expected = flash.backward(dout, q, k, v, out, lse, None, causal, scale)
    got = math_kernel.backward(dout, q, k, v, out, lse, None, causal, scale)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e, atol=FP32_TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
