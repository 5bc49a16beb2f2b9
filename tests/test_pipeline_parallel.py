"""Pipeline parallelism against one process: losses, weights, logged metrics, predictions, checkpoints, errors.

Every schedule runs at pp=2 and pp=4, spread over the example GPT, Hugging Face Llama and GPT-2 (tied
embedding and head), with gradient accumulation and clipping on several of them; pp2 x dp2 adds replicas and
pp2 x tp2 sharded (DTensor) stages. Library block containers at pp=2: blocks in an nn.ModuleDict (as torchtitan
keeps them) and a litgpt-shaped model, which registers its head before the blocks and runs it after. The model
zoo at pp=2 (torch's nn.TransformerEncoder, which indexes its layers, and OPT, which registers its final norm
before its layers, among them) and the encoder-decoder refusal: tests/test_zoo.py.
Tolerances: 1e-5 relative on losses and logged values, 1e-5 + 1e-5 * |w| on weights (SGD, see
``tests/lm_models.py``). A missing micro-batch, a gradient divided twice, a tied gradient not summed or a
clipping norm over one stage only are all far outside these bounds.

The models, probes and callbacks below run inside the worker processes (``module:factory`` specs).
"""

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from lightning_4d.pipeline import SCHEDULES
from lightning_4d.pipeline.microbatch import split_batch
from tests.lm_models import VOCAB, TinyGPT, token_data
from tests.parity import (Case, assert_exact_resume, assert_parity, rank_tails, reference, run_layout,
                          train_layout)

# ------------------------------------------------------------------------- worker-side models and probes


class MetricGPT(TinyGPT):
    """The example GPT with torchmetrics accuracies logged on step and epoch, and a max-reduced value."""

    def __init__(self, **config) -> None:
        super().__init__(**config)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=config["vocab_size"])
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=config["vocab_size"])
        self.step_calls = 0
        self.metric_updates = 0

    def training_step(self, batch, batch_idx):
        self.step_calls += 1
        input_ids, labels = batch
        logits = self(input_ids).reshape(-1, VOCAB)
        loss = F.cross_entropy(logits, labels.reshape(-1))
        self.train_acc(logits, labels.reshape(-1))
        self.metric_updates += 1
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("max_logit", logits.max(), reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        input_ids, labels = batch
        logits = self(input_ids).reshape(-1, VOCAB)
        self.val_acc.update(logits, labels.reshape(-1))
        self.log("val_loss", F.cross_entropy(logits, labels.reshape(-1)), sync_dist=True)
        self.log("val_acc", self.val_acc)


def metric_gpt(**overrides) -> MetricGPT:
    return MetricGPT(**{**dict(vocab_size=VOCAB, n_layer=8, n_head=4, n_embd=32, block_size=64), **overrides})


class StageProbe(Callback):
    """Per-rank facts, gathered to rank 0: pipeline coordinate, parameter count, user step calls."""

    def on_fit_start(self, trainer, pl_module):
        self.params = sum(p.numel() for p in pl_module.parameters())

    def parity_extras(self, trainer):
        module = trainer.lightning_module
        mine = {"pp": trainer.strategy.parallel_dims.coordinates(trainer.global_rank)["pp"], "params": self.params,
                "step_calls": module.step_calls, "metric_updates": module.metric_updates}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}


def _held_out() -> DataLoader:
    return DataLoader(token_data(train=False, size=16), batch_size=8)


class PredictTestExport(Callback):
    """After fit: trainer.predict and trainer.test through the pipeline, then a checkpoint read back in one
    process (it must hold every stage's final weights, nothing stale)."""

    def parity_extras(self, trainer):
        from lightning_4d.checkpoint import read_checkpoint

        predictions = trainer.predict(trainer.lightning_module, dataloaders=_held_out())
        tested = trainer.test(trainer.lightning_module, dataloaders=_held_out(), verbose=False)
        scratch = tempfile.mkdtemp(prefix="l4d-pp-") if trainer.global_rank == 0 else None
        path = Path(trainer.strategy.broadcast(scratch)) / "final"
        trainer.save_checkpoint(path)
        exported = read_checkpoint(path)["state_dict"] if trainer.global_rank == 0 else None
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            shutil.rmtree(path.parent)
        return {"predictions": torch.cat(predictions), "test": tested, "exported": exported}


# Checkpoint directories of these tests (also Lightning's default one of the single-process reference runs,
# which get enable_checkpointing=True with the monitored cases); removed when the tests end.
SCRATCH = Path(tempfile.gettempdir()) / "l4d-pp-tests"


class MonitoredCheckpoint(ModelCheckpoint):
    """ModelCheckpoint(monitor="val_loss") in a throwaway directory; reports the best score it kept."""

    def __init__(self) -> None:
        super().__init__(dirpath=SCRATCH / f"monitored-{os.environ['MASTER_PORT']}", monitor="val_loss",
                         save_top_k=1)

    def parity_extras(self, trainer):
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            shutil.rmtree(self.dirpath, ignore_errors=True)
        return {"best_val_loss": float(self.best_model_score)}


def early_stopping() -> EarlyStopping:
    return EarlyStopping(monitor="val_loss", patience=100)


# ------------------------------------------------------------------------------------------- cases

GPT = dict(module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data")
METRIC_GPT = dict(module="tests.test_pipeline_parallel:metric_gpt", data="tests.lm_models:token_data")
HF = dict(module="tests.lm_models:HFCausalLM", data="tests.lm_models:token_data")
VALIDATE = {"limit_val_batches": 2, "val_check_interval": 2}
ACCUMULATE_CLIP = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
MONITORED = ["tests.test_pipeline_parallel:MonitoredCheckpoint", "tests.test_pipeline_parallel:early_stopping"]
VALIDATE_MONITORED = {**VALIDATE, "enable_checkpointing": True, "default_root_dir": str(SCRATCH)}


def _pp(name, pp, model, schedule, *, layers, kind=None, dp=1, tp=1, trainer=None, steps=3, callbacks=(),
        **options):
    module_kwargs = {"kind": kind, "layers": layers} if kind else {"n_layer": layers}
    return Case(name, **model, strategy={"pp": pp, "dp": dp, "tp": tp, "pp_schedule": schedule, **options},
                trainer=trainer or {}, module_kwargs=module_kwargs, max_steps=steps, callbacks=list(callbacks))


TWO = [
    _pp("pp2_gpt_gpipe_metrics", 2, METRIC_GPT, "gpipe", layers=8, trainer=VALIDATE_MONITORED, steps=4,
        callbacks=["tests.test_pipeline_parallel:StageProbe", "tests.test_pipeline_parallel:PredictTestExport",
                   *MONITORED]),
    _pp("pp2_gpt_1f1b_accumulate_clip", 2, GPT, "1f1b", layers=4, trainer=ACCUMULATE_CLIP,
        callbacks=["tests.probes:GradientLifetimeProbe"]),
    _pp("pp2_llama_interleaved_1f1b", 2, HF, "interleaved_1f1b", kind="llama", layers=4, trainer=VALIDATE, steps=4),
    _pp("pp2_gpt2_1f1b_accumulate_clip", 2, HF, "1f1b", kind="gpt2", layers=4, trainer=ACCUMULATE_CLIP),
    _pp("pp2_gpt2_zbv_accumulate_clip", 2, HF, "zbv_zero_bubble", kind="gpt2", layers=4, trainer=ACCUMULATE_CLIP),
    _pp("pp2_llama_looped_bfs_clip", 2, HF, "looped_bfs", kind="llama", layers=4,
        trainer={"gradient_clip_val": 0.05}),
    _pp("pp2_gpt_interleaved_zero_bubble", 2, GPT, "interleaved_zero_bubble", layers=4, pp_microbatches=2),
    _pp("pp2_gpt_dualpipev_split", 2, GPT, "dualpipev", layers=6, pp_split_points=[1, 3, 5]),
    # A tied weight whose gradient only the last stage forms: the first stage reads whether the other formed one.
    Case("pp2_tied_gradient_on_one_end", module="tests.lm_models:head_trained_tied_gpt",
         data="tests.lm_models:token_data", strategy={"pp": 2}, max_steps=3),
    Case("pp2_gpt_resumed", **GPT, strategy={"pp": 2}, max_steps=4, resume_at=2),
    # Block containers of library code: blocks in an nn.ModuleDict run with .values() (torch's
    # nn.TransformerEncoder, which reads self.layers[0] in its forward, is in the zoo: tests/test_zoo.py).
    Case("pp2_module_dict_blocks", module="tests.zoo_models:ModuleDictLM", data="tests.lm_models:token_data",
         strategy={"pp": 2}, max_steps=3),
    # Modules registered on one side of the blocks that run on the other: litgpt's lm_head (before transformer)
    # goes to the last stage, where its forward uses it (OPT's final_layer_norm: tests/test_zoo.py).
    Case("pp2_head_registered_first", module="tests.zoo_models:HeadFirstLM", data="tests.lm_models:token_data",
         strategy={"pp": 2}, max_steps=3),
]
FOUR = [
    _pp("pp4_gpt_gpipe_accumulate_clip", 4, GPT, "gpipe", layers=8, trainer=ACCUMULATE_CLIP),
    _pp("pp4_llama_1f1b", 4, HF, "1f1b", kind="llama", layers=4, trainer=VALIDATE, steps=4),
    _pp("pp4_gpt2_interleaved_1f1b_clip", 4, HF, "interleaved_1f1b", kind="gpt2", layers=8,
        trainer={"gradient_clip_val": 0.05}),
    _pp("pp4_gpt_looped_bfs", 4, GPT, "looped_bfs", layers=8),
    _pp("pp4_llama_interleaved_zero_bubble", 4, HF, "interleaved_zero_bubble", kind="llama", layers=8),
    _pp("pp4_gpt2_zbv_accumulate_clip", 4, HF, "zbv_zero_bubble", kind="gpt2", layers=8, trainer=ACCUMULATE_CLIP),
    _pp("pp4_gpt_dualpipev", 4, GPT, "dualpipev", layers=8),
    _pp("pp2_dp2_gpt2_1f1b_accumulate_clip", 2, HF, "1f1b", kind="gpt2", layers=4, dp=2,
        trainer={**ACCUMULATE_CLIP, **VALIDATE_MONITORED}, steps=4, callbacks=MONITORED),
    _pp("pp2_tp2_gpt_interleaved_1f1b_clip", 2, GPT, "interleaved_1f1b", layers=4, tp=2,
        trainer={"gradient_clip_val": 0.05}),
    _pp("pp2_tp2_gpt2_1f1b_accumulate_clip", 2, HF, "1f1b", kind="gpt2", layers=4, tp=2,
        trainer={**ACCUMULATE_CLIP, **VALIDATE}, steps=4),
]
CASES = {case.name: case for case in TWO + FOUR}


@pytest.fixture(scope="module", autouse=True)
def scratch():
    yield
    shutil.rmtree(SCRATCH, ignore_errors=True)


@pytest.fixture(scope="module")
def two_launch():
    result = run_layout(TWO, 2, timeout=400)
    assert all(code == 0 for code in result.returncodes), \
        f"ranks failed: {result.returncodes}\n{rank_tails(result.output)}"
    return result


@pytest.fixture(scope="module")
def two(two_launch):
    return two_launch.results


def test_the_pipeline_plan_is_printed_at_start_up(two_launch):
    """Rank 0 prints, once per module, which modules each stage holds and on which pipeline rank."""
    assert "pipeline plan: pp=2, schedule 1f1b, 4 micro-batches, 2 stages, blocks model.layers (4)" in two_launch.output
    assert "  stage 0 (pp rank 0): model.tok_emb, model.layers.0-1" in two_launch.output, two_launch.output[-3000:]
    assert "  stage 1 (pp rank 1): model.layers.2-3, model.norm, model.lm_head" in two_launch.output


@pytest.fixture(scope="module")
def four():
    return train_layout(FOUR, 4, timeout=500)


def _epoch_metrics(case):
    if case.module == METRIC_GPT["module"]:
        return ("train_acc_epoch", "val_loss", "val_acc")
    return ("val_loss",) if case.trainer.get("limit_val_batches") else ()


def _check(results, name):
    case = CASES[name]
    metrics = ("train_loss", "train_acc_step", "max_logit") if case.module == METRIC_GPT["module"] else ("train_loss",)
    assert_parity(case, reference(case), results[name], metrics=metrics, epoch_metrics=_epoch_metrics(case))


@pytest.mark.parametrize("name", [c.name for c in TWO])
def test_pp2_matches_single_process(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", [c.name for c in FOUR])
def test_pp4_pp2_dp2_and_pp2_tp2_match_single_process(four, name):
    _check(four, name)


def test_the_cases_cover_every_schedule_at_pp2_and_pp4():
    for cases, pp in ((TWO, 2), (FOUR, 4)):
        ran = {c.strategy.get("pp_schedule") for c in cases
               if c.strategy["pp"] == pp and c.strategy.get("dp", 1) == c.strategy.get("tp", 1) == 1}
        assert ran >= set(SCHEDULES), (pp, set(SCHEDULES) - ran)


def test_each_stage_holds_its_share_and_runs_the_user_step_once_per_micro_batch(two):
    stages = sorted(two["pp2_gpt_gpipe_metrics"]["extras"]["ranks"], key=lambda rank: rank["pp"])
    whole = sum(p.numel() for p in metric_gpt().parameters())
    for stage in stages:
        assert stage["params"] <= 0.6 * whole, (stage, whole)
    # 4 training steps x 4 micro-batches: every stage ran the user's training_step 16 times (never on
    # placeholder activations); only the last stage reached the metric update, once per micro-batch.
    assert [s["step_calls"] for s in stages] == [16, 16]
    assert [s["metric_updates"] for s in stages] == [0, 16]


def test_the_previous_windows_gradients_are_freed_before_the_schedule_runs(two):
    """3 optimizer steps of 2 accumulated batches: at the 2nd and 3rd windows' zero_grad, none of the previous
    window's gradients is alive on either stage (they used to be set aside during the schedule)."""
    assert two["pp2_gpt_1f1b_accumulate_clip"]["extras"]["alive_at_zero_grad"] == [[0, 0], [0, 0]]


def test_predict_test_and_checkpoint_through_the_pipeline(two):
    case = CASES["pp2_gpt_gpipe_metrics"]
    expected, got = reference(case), two[case.name]
    single = metric_gpt()
    single.load_state_dict(expected["weights"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    predictions = torch.cat(trainer.predict(single, dataloaders=_held_out()))
    assert torch.equal(got["extras"]["predictions"], predictions)
    tested = trainer.test(single, dataloaders=_held_out(), verbose=False)
    assert got["extras"]["test"][0]["test_loss"] == pytest.approx(tested[0]["test_loss"], rel=1e-5)
    # The checkpoint holds the trained weights of both stages, each written by its owner.
    exported = got["extras"]["exported"]
    assert set(exported) == set(got["weights"])
    for key, value in got["weights"].items():
        assert torch.equal(exported[key], value), key


def test_monitored_checkpoint_and_early_stopping_see_the_real_val_loss(two, four):
    for results, name in ((two, "pp2_gpt_gpipe_metrics"), (four, "pp2_dp2_gpt2_1f1b_accumulate_clip")):
        record = results[name]
        logged = [seen["val_loss"] for seen in record["logged"] + record["epochs"] if "val_loss" in seen]
        assert logged and record["extras"]["best_val_loss"] == pytest.approx(min(logged), rel=1e-6), name


def test_resume_continues_exactly(two):
    assert_exact_resume(two["pp2_gpt_resumed"])


# ---------------------------------------------------------------------- errors, before any collective


def test_schedule_names_accept_torch_spelling_and_yaml():
    from jsonargparse import ArgumentParser

    assert FourDStrategy(pp=2, pp_schedule="ZBVZeroBubble").pp_config.schedule == "zbv_zero_bubble"
    parser = ArgumentParser()
    parser.add_class_arguments(FourDStrategy, "strategy")
    config = parser.parse_args(["--strategy.pp=2", "--strategy.pp_schedule=interleaved_1f1b",
                                "--strategy.pp_microbatches=8", "--strategy.pp_split_points=[1, 2, 3]",
                                "--strategy.pp_blocks=model.layers"])
    pipeline = parser.instantiate_classes(config).strategy.pp_config
    assert (pipeline.num_microbatches, pipeline.split_points, pipeline.blocks) == (8, (1, 2, 3), "model.layers")


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Features:
    tokens: torch.Tensor
    mask: torch.Tensor
    note: str


def test_any_batch_structure_splits():
    """(An uneven batch is refused: tests/test_bad_inputs.py.)"""
    tokens = torch.arange(24).view(8, 3)
    batch = {"pair": Pair(tokens, tokens * 2), "features": Features(tokens, tokens > 4, "kept"),
             "list": [tokens, torch.tensor(1.0)]}
    parts = split_batch(batch, 4)
    assert len(parts) == 4
    for i, part in enumerate(parts):
        assert isinstance(part["pair"], Pair) and isinstance(part["features"], Features)
        assert torch.equal(part["pair"].y, tokens[2 * i:2 * i + 2] * 2)
        assert torch.equal(part["features"].mask, tokens[2 * i:2 * i + 2] > 4) and part["features"].note == "kept"
        assert torch.equal(part["list"][0], tokens[2 * i:2 * i + 2]) and part["list"][1] == 1.0
