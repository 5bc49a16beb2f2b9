"""The composition without a Trainer: ``parallelize`` a module in plain torch, train it by hand, and get the
numbers of one process; its plans are pure and say what each rank holds."""

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_4d.context_parallel.config import ContextParallelConfig
from lightning_4d.parallel_dims import ParallelDims
from lightning_4d.composition.parallelize import parallelize
from lightning_4d.composition.plans import make_plans
from lightning_4d.pipeline import PipelineConfig
from lightning_4d.tensor_parallel import TensorParallelConfig
from tests.lm_models import NanoGPT, sgd, tiny_gpt, token_data
from tests.parity import free_port, spawn


# Two layouts of 4 processes, run one after the other by the same ranks.
LAYOUTS = {
    "nanogpt-pp2-tp2": (NanoGPT, dict(dp=1, pp=2, cp=1, tp=2)),  # weights tied across the stages, fused qkv
    "gpt-dp2-cp2": (tiny_gpt, dict(dp=2, pp=1, cp=2, tp=1)),  # rotary tables, ring attention, gradient buckets
}
STEPS, BATCH, SEED, CLIP = 3, 8, 7, 0.5


def _batches():
    data = token_data()
    return [tuple(t[i * BATCH:(i + 1) * BATCH] for t in data.tensors) for i in range(STEPS)]


def _train_one_process(factory) -> dict:
    torch.manual_seed(SEED)
    module = factory()
    optimizer = sgd(module)
    losses = []
    for index, batch in enumerate(_batches()):
        optimizer.zero_grad()
        loss = module.training_step(batch, index)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def _worker(rank: int, world_size: int, out_dir: str, port: int, keep_dir: str) -> None:
    """One rank: both layouts in turn; rank 0 keeps the records in ``keep_dir``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # self.log without a Trainer warns; nothing is logged here
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    records = {}
    for name, (factory, sizes) in LAYOUTS.items():
        dims = ParallelDims.resolve(world_size, **sizes)
        mesh = dims.build("cpu")
        torch.manual_seed(SEED + rank)  # other weights on every rank: parallelize must start all from rank 0's
        module = factory()
        options = dict(pipeline=PipelineConfig(dims.pp), tensor=TensorParallelConfig(dims.tp),
                       context=ContextParallelConfig(dims.cp))
        parallel = parallelize(module, mesh, torch.device("cpu"), **options)
        again = parallelize(module, mesh, torch.device("cpu"), **options)
        try:
            parallelize(module, mesh, torch.device("cpu"), **dict(options, tensor=TensorParallelConfig(dims.tp, "none")))
            refused = "no error"
        except ValueError as error:
            refused = str(error)
        optimizer = sgd(module)  # after parallelize, which replaced sharded parameters
        parallel.attach_optimizers([optimizer])
        replica, replicas = mesh.local_rank("dp"), dims.dp
        losses = []
        for index, (inputs, labels) in enumerate(_batches()):
            part = slice(replica * BATCH // replicas, (replica + 1) * BATCH // replicas)
            batch = parallel.shard_batch((inputs[part], labels[part]))

            def closure():
                loss = parallel.step("training_step", (batch, index), {})
                optimizer.zero_grad()  # where Lightning calls it: after the step, before backward
                parallel.backward(loss.backward)
                return loss

            loss = parallel.synchronizing(optimizer, closure)().detach()
            parallel.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], CLIP)
            optimizer.step()
            dist.all_reduce(loss, group=mesh.group("dp"))
            losses.append(loss.item() / replicas)
        weights = parallel.full_state()
        records[name] = {"losses": losses, "same_object": again is parallel, "refused": refused,
                         "plan": parallel.describe(), "weights": {k: v.tolist() for k, v in weights.items()}}
    if rank == 0:
        torch.save(records, os.path.join(keep_dir, "records.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write("{}")
    dist.destroy_process_group()


def test_plans_are_pure_and_say_what_each_rank_holds():
    module = NanoGPT(n_layer=4)
    plans = make_plans(module, ParallelDims.resolve(4, dp=1, pp=2, tp=2), pipeline=PipelineConfig(2),
                       tensor=TensorParallelConfig(2))
    pipeline = plans.pipeline
    assert pipeline.stages_of(0) == [0] and pipeline.stages_of(1) == [1]
    text = plans.describe()
    assert "tensor parallel plan: tp=2" in text
    assert "stage 0 (pp rank 0): transformer.wte, transformer.wpe, transformer.h.0-1, lm_head" in text, text
    assert "stage 1 (pp rank 1): transformer.wte, transformer.h.2-3, transformer.ln_f, lm_head" in text, text
    assert "gradients summed: transformer.wte.weight = lm_head.weight" in text, text
    assert pipeline.held_modules(0) == {"transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                                        "lm_head"}
    assert pipeline.held_modules(1) == {"transformer.wte", "transformer.h.2", "transformer.h.3", "transformer.ln_f",
                                        "lm_head"}
    assert pipeline.state_keys == set(module.state_dict())


def test_parallelize_without_a_trainer_trains_as_one_process(tmp_path):
    spawn(_worker, 4, 300, free_port(), str(tmp_path))
    records = torch.load(tmp_path / "records.pt", weights_only=False)
    for name, (factory, _) in LAYOUTS.items():
        got, expected = records[name], _train_one_process(factory)
        assert got["same_object"], name
        assert "already parallelized with other options" in got["refused"], got["refused"]
        for step, (a, b) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name}: loss at step {step}: {a} vs one process {b}"
        assert set(got["weights"]) == set(expected["weights"]), name
        for key, ref in expected["weights"].items():
            torch.testing.assert_close(torch.tensor(got["weights"][key]), ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {key}: {m}")
    assert "pipeline plan: pp=2" in records["nanogpt-pp2-tp2"]["plan"]


def _mesh_worker(rank: int, world_size: int, out_dir: str, port: int, second_port: int) -> None:
    """Build layouts as every fit, validate, test and predict does: each layout's groups once per default group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    first = ParallelDims.resolve(world_size, dp=2).build("cpu")
    again = ParallelDims.resolve(world_size, dp=2).build("cpu")  # a later entry point, or another Trainer
    other = ParallelDims.resolve(world_size, pp=2).build("cpu")
    dp = torch.ones(1)
    dist.all_reduce(dp, group=again.group("dp"))
    dist.destroy_process_group()  # a new default group: its layouts are built again, on it
    os.environ["MASTER_PORT"] = str(second_port)  # a new store (rendezvous again on the first port can hang)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fresh = ParallelDims.resolve(world_size, dp=2).build("cpu")
    after = torch.ones(1)
    dist.all_reduce(after, group=fresh.group("dp"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "reused": again is first and again.group("dp") is first.group("dp"), "other_layout_new": other is not first,
        "rebuilt_after_new_world": fresh is not first, "sums": [dp.item(), after.item()]}))
    dist.destroy_process_group()


def test_a_layout_is_built_once_per_process_group_and_reused():
    """Lightning calls ``setup_environment`` on every fit, validate, test and predict; building the layout each
    time created more process groups per call (6 at pp=2 on gloo, each with its threads and sockets; on NCCL
    communicators and their buffers), kept until the process exits."""
    first = free_port()
    second = next(port for port in iter(free_port, None) if port != first)
    for result in spawn(_mesh_worker, 2, 120, first, second):
        assert result == {"reused": True, "other_layout_new": True, "rebuilt_after_new_world": True,
                          "sums": [2.0, 2.0]}, result
