"""The pipeline's step results from the last stage to the others (lightning_4d/pipeline/results.py), without a
Trainer: 80 exchanges between two gloo ranks whose structure changes at some steps (a name logged every tenth
step only, a dict output, a problem string, an int64 count), past the window after which old store keys are
deleted. Every exchange arrives equal to what was sent, values and structure; the store holds at most the
window's keys."""

import torch
import torch.distributed as dist

from tests.parity import free_port, spawn

STEPS = 80


def _results(step: int):
    """What a last stage might send at ``step``: a loss, logs (one name only every tenth step), a count."""
    logs = {"train_loss": (torch.tensor(float(step)), {"on_step": True, "reduce_fx": "mean"})}
    if step % 10 == 0:
        logs["rare"] = (torch.arange(3.0) + step, {"on_step": True, "prog_bar": True})
    output = {"loss": torch.tensor(step / 2), "extra": torch.full((2, 2), step, dtype=torch.int64)} if step % 7 == 0 \
        else torch.tensor(step / 2)
    return output, logs, {}, torch.tensor(step + 100, dtype=torch.int64), ("a problem" if step == 33 else None)


def _worker(rank: int, world_size: int, out_dir: str, port: int) -> None:
    import json
    import os

    from lightning_4d import _compat as compat
    from lightning_4d.pipeline import results

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    exchange = results.ResultExchange(dist.group.WORLD, 1, torch.device("cpu"))
    mismatches = []
    for step in range(1, STEPS + 1):
        sent = _results(step)
        got = exchange.exchange(sent if rank == 1 else None)
        if repr(got) != repr(sent):
            mismatches.append(step)
    dist.barrier()
    store = compat.default_store()
    kept = [step for step in range(1, STEPS + 1) if store.check([f"{exchange._prefix}{step}"])]
    dist.barrier()  # rank 0 hosts the store: it must not leave while rank 1 still reads it
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"mismatches": mismatches, "kept": kept}, f)
    dist.destroy_process_group()


def test_results_arrive_whole_as_their_structure_changes():
    outcome = spawn(_worker, 2, 120, free_port())
    assert outcome[0]["mismatches"] == [] and outcome[1]["mismatches"] == []
    assert outcome[0]["kept"] == list(range(STEPS - results_window() + 1, STEPS + 1)), outcome[0]["kept"]


def results_window() -> int:
    from lightning_4d.pipeline.results import _KEPT_STEPS
    return _KEPT_STEPS
