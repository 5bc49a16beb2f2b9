"""A steady-state training step makes no host wait for the device on lightning_4d's account, in every layout.

Counted by :mod:`tests.host_syncs` over steps 3 to 8 of 10 (none a logging step), on every rank, with every
default feature on (fault handling and preemption agreement, token-mean losses, logging under cp, the pipeline's
results): device-to-host reads, tensors built from host data, synchronous / object / barrier collectives, each
attributed to the code that asked. Lightning's own (``self.log(sync_dist=True)``, its SIGTERM broadcast) are
counted and shown, not asserted. One 2-process launch runs dp2, dp_shard2, tp2, pp2, pp2 with the embedding tied
to the head (the two end stages sum its gradient), cp2 (ring and Ulysses; Hugging Face models masking padding,
packed documents and a sliding window, a hand-written document mask), ep2, the common additions (norm clipping
with gradient accumulation at dp2, dp_shard2, tp2 with sequence parallelism and tied pp2; manual optimization at
dp2), a debug-mode run and Lightning's DDPStrategy and ModelParallelStrategy + FSDP2; one 8-process launch runs
dp2 x pp2 x cp2.

``pytest tests/test_host_syncs.py -s`` prints the table in docs/performance.md ("Host syncs per step").
"""

import json
import math

import pytest

from tests.parity import launch, rank_tails

TWO = ["dp2", "dp_shard2", "tp2", "pp2", "pp2_tied", "cp2", "cp2_a2a", "cp2_padded_llama", "cp2_packed_llama",
       "cp2_window_mistral", "cp2_documents", "ep2", "dp2_clip_accumulate",
       "dp_shard2_clip_accumulate", "tp2_sp_clip_accumulate", "pp2_tied_clip_accumulate", "dp2_manual", "tp2_debug",
       "lightning_ddp", "lightning_fsdp2"]
EIGHT = ["dp2_pp2_cp2"]
WORLD = {**{name: 2 for name in TWO}, **{name: 8 for name in EIGHT}}
FOURD = [name for name in TWO + EIGHT if not name.startswith("lightning_") and name != "tp2_debug"]
HOST_WAITS = ("read", "host_tensor", "object_collective", "barrier", "sync_collective")

@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_syncs")
    for names, world in ((TWO, 2), (EIGHT, 8)):
        codes, output = launch(["-m", "tests.host_sync_script", str(out), *names], world, timeout=480)
        assert codes == [0] * world, rank_tails(output)
    records = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    missing = [f"{name}-rank{rank}" for name in WORLD for rank in range(WORLD[name])
               if f"{name}-rank{rank}" not in records]
    assert not missing, missing
    print("\n" + table(records))
    return records


def _waits(record: dict, package: str = "lightning_4d") -> list[dict]:
    return [c for c in record["counts"] if c["package"] == package and c["kind"] in HOST_WAITS]


def _ranks(counts: dict, name: str) -> list[dict]:
    return [counts[f"{name}-rank{rank}"] for rank in range(WORLD[name])]


@pytest.mark.parametrize("layout", FOURD)
def test_no_host_wait_from_lightning_4d(counts, layout):
    for record in _ranks(counts, layout):
        assert record["loss"] is not None and math.isfinite(record["loss"]), record["loss"]
        assert _waits(record) == [], (record["rank"], _waits(record))
        # what it does issue per step runs asynchronously: at least the step's agreement
        assert any(c["kind"] == "async_collective" and c["package"] == "lightning_4d" for c in record["counts"])


def test_the_counter_sees_a_host_wait_put_back(counts):
    """Debug mode puts the batch-shape comparison (a host read of every rank's shapes) and the weight
    fingerprints (object collectives) back into every step: the assertion above fails on it."""
    for record in _ranks(counts, "tp2_debug"):
        sites = {(c["kind"], c["site"].split(":")[0]) for c in _waits(record)}
        assert ("read", "lightning_4d/faults/callback.py") in sites, sites
        assert ("object_collective", "lightning_4d/observability/desync.py") in sites, sites


def test_lightning_strategies_are_counted_too(counts):
    """The baselines: Lightning's own waits are seen (its SIGTERM broadcast reads a tensor every step), so a
    count of zero above is not a counter that sees nothing."""
    for name in ("lightning_ddp", "lightning_fsdp2"):
        for record in _ranks(counts, name):
            assert _waits(record) == []
            assert any(c["kind"] == "read" for c in _waits(record, "lightning")), record["counts"]


def test_lightning_sigterm_broadcast_is_left_out_under_fourd(counts):
    """Lightning broadcasts its SIGTERM flag over the world before every batch and reads it (a blocking collective
    and a host read per step); FourD's fault tolerance holds SIGTERM and agrees on it in its own step agreement, so
    it leaves that broadcast out. Lightning's DDPStrategy keeps it: the counter sees it there."""
    def sigterm(record):
        return [c for c in record["counts"] if c["site"].endswith("training_epoch_loop.py:_broadcast_sigterm_tensor")]

    for layout in FOURD:
        for record in _ranks(counts, layout):
            assert sigterm(record) == [], (layout, record["rank"], sigterm(record))
    for record in _ranks(counts, "lightning_ddp"):
        assert {c["what"] for c in sigterm(record)} >= {"broadcast", "item"}, sigterm(record)


def table(counts: dict) -> str:
    """The table for docs/performance.md: rank 0's counts per step (stage 0 under pp)."""
    def total(record, package, kinds):
        return sum(c["per_step"] for c in record["counts"] if c["package"] == package and c["kind"] in kinds)

    blocking = ("sync_collective", "object_collective", "barrier")
    lines = ["| layout | device-to-host reads, lightning_4d / Lightning | host-built tensors, lightning_4d / Lightning"
             " | blocking, object or barrier collectives, lightning_4d / Lightning | asynchronous collectives,"
             " lightning_4d | staged host values, lightning_4d |", "|---|---|---|---|---|---|"]
    for name in FOURD + ["tp2_debug", "lightning_ddp", "lightning_fsdp2"]:
        record = counts[f"{name}-rank0"]
        lines.append(
            f"| {name} | {total(record, 'lightning_4d', ('read',)):g} / {total(record, 'lightning', ('read',)):g}"
            f" | {total(record, 'lightning_4d', ('host_tensor',)):g} / {total(record, 'lightning', ('host_tensor',)):g}"
            f" | {total(record, 'lightning_4d', blocking):g} / {total(record, 'lightning', blocking):g}"
            f" | {total(record, 'lightning_4d', ('async_collective', 'functional_collective')):g}"
            f" | {total(record, 'lightning_4d', ('staging',)):g} |")
    return "\n".join(lines)
