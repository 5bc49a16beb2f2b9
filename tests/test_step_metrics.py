"""``context_parallel.step_metrics``: a torchmetrics metric's per-step value while a step runs sharded is the
whole batch's (the cp runs are in tests/test_cp_step_check.py); a metric whose states torchmetrics concatenates is
refused, naming it. One spawned process with a process group of one (its all-reduces change nothing), so the
values are the metric's own forward's."""

from __future__ import annotations

import json
import os

from tests.parity import free_port, spawn


def _one_rank(rank: int, world_size: int, out_dir: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torchmetrics
    from torch import nn

    from lightning_4d.context_parallel.step_metrics import WholeBatchMetrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    module = nn.Module()
    module.acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
    module.perplexity = torchmetrics.text.Perplexity()
    module.retrieval = torchmetrics.CatMetric()  # its state is a list
    reference = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=4),
                 "perplexity": torchmetrics.text.Perplexity()}
    generator = torch.Generator().manual_seed(0)
    preds, target = torch.randint(4, (16,), generator=generator), torch.randint(4, (16,), generator=generator)
    logits, tokens = torch.randn(2, 6, 5, generator=generator), torch.randint(5, (2, 6), generator=generator)
    metrics = WholeBatchMetrics(module, dist.group.WORLD)
    with metrics.running():
        got = {"acc": float(module.acc(preds, target)), "perplexity": float(module.perplexity(logits, tokens))}
        try:
            module.retrieval(torch.ones(3))
            refusal = ""
        except ValueError as error:
            refusal = str(error)
    expected = {"acc": float(reference["acc"](preds, target)),
                "perplexity": float(reference["perplexity"](logits, tokens))}
    epoch = {"acc": float(module.acc.compute()), "perplexity": float(module.perplexity.compute())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"got": got, "expected": expected, "epoch": epoch, "refusal": refusal,
                   "forward_restored": "forward" not in vars(module.acc)}, f)
    dist.destroy_process_group()


def test_step_values_epoch_states_and_the_refusal():
    [result] = spawn(_one_rank, 1, 120, free_port())
    assert result["got"] == result["expected"]  # a group of one: exactly the metric's own forward
    assert result["epoch"] == result["expected"]  # the epoch state was updated once, as forward does
    assert "retrieval (CatMetric)" in result["refusal"] and "'value' is reduced over processes by 'cat'" in \
        result["refusal"] and "on_step=False, on_epoch=True" in result["refusal"], result["refusal"]
    assert result["forward_restored"]
