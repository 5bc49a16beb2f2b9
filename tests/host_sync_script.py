"""Run by tests/test_host_syncs.py under tests.parity.launch: one Trainer per layout in turn, each counting what its
steady-state steps (3 to 8 of 10, none a logging step) make the host wait for (:mod:`tests.host_syncs`).

    python tests/host_sync_script.py OUT_DIR NAME [NAME ...]      # in every rank of the launch

NAMEs: the layouts below. Each rank writes ``OUT_DIR/NAME-rank<r>.json``: the counts per step by kind, package and
site, and the last loss (so a run that trained nothing cannot pass).
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from tests.host_syncs import CountSteps
from tests.lm_models import TINY_GPT, TinyGPT, manual_gpt, token_data

STEPS = 10
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: a finished fit may leave it changed
GPT = TINY_GPT


class ShardedByHand(TinyGPT):
    """The example GPT as ModelParallelStrategy wants it: FSDP2's ``fully_shard`` per block and at the root."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _gpt():
    return TinyGPT(**GPT)


def _tied_gpt():
    return TinyGPT(**GPT, tie_weights=True)


def _masked(family: str):
    from tests.cp_mask_models import MaskedLM
    return MaskedLM(family=family)


def _documents():
    from tests.cp_mask_models import DocumentAttentionLM
    return DocumentAttentionLM()


def _moe():
    from tests.moe_models import HFMoELM
    return HFMoELM(kind="qwen2_moe")


# name -> (model, strategy). The "lightning_*" runs are Lightning's own strategies, the baseline beside FourD's.
LAYOUTS = {
    "dp2": (_gpt, lambda: FourDStrategy(dp=2)),
    "dp_shard2": (_gpt, lambda: FourDStrategy(dp_shard=2)),
    "tp2": (_gpt, lambda: FourDStrategy(tp=2)),
    "pp2": (_gpt, lambda: FourDStrategy(pp=2)),
    # the embedding and the head share their weight: the first and the last stage sum its gradient every step
    "pp2_tied": (_tied_gpt, lambda: FourDStrategy(pp=2)),
    "cp2": (_gpt, lambda: FourDStrategy(cp=2)),
    "cp2_a2a": (_gpt, lambda: FourDStrategy(cp=2, cp_comm="a2a")),
    # Hugging Face models building their masks from the batch (DATA): padding, packed documents, a sliding window,
    # and a hand-written model's document mask (cp_document_key)
    "cp2_padded_llama": (lambda: _masked("llama"), lambda: FourDStrategy(cp=2)),
    "cp2_packed_llama": (lambda: _masked("llama"), lambda: FourDStrategy(cp=2)),
    "cp2_window_mistral": (lambda: _masked("mistral"), lambda: FourDStrategy(cp=2)),
    "cp2_documents": (lambda: _documents(), lambda: FourDStrategy(cp=2, cp_document_key="document_ids")),
    "ep2": (_moe, lambda: FourDStrategy(ep=2)),
    "dp2_pp2_cp2": (_gpt, lambda: FourDStrategy(dp=2, pp=2, cp=2)),
    # what people add to these: norm clipping and accumulation (TRAINER), manual optimization
    "dp2_clip_accumulate": (_gpt, lambda: FourDStrategy(dp=2)),
    "dp_shard2_clip_accumulate": (_gpt, lambda: FourDStrategy(dp_shard=2)),
    "tp2_sp_clip_accumulate": (_gpt, lambda: FourDStrategy(tp=2, sequence_parallel=True)),
    "pp2_tied_clip_accumulate": (_tied_gpt, lambda: FourDStrategy(pp=2)),
    "dp2_manual": (lambda: manual_gpt(accumulate=2, chunks=2), lambda: FourDStrategy(dp=2)),
    # debug mode compares batch shapes and fingerprints weights every step: the counter must see it
    "tp2_debug": (_gpt, lambda: FourDStrategy(tp=2, debug=True, debug_steps=STEPS)),
    "lightning_ddp": (_gpt, lambda: "ddp"),
    "lightning_fsdp2": (lambda: ShardedByHand(**GPT), lambda: _model_parallel()),
}


CLIP_ACCUMULATE = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)
TRAINER = {name: CLIP_ACCUMULATE for name in LAYOUTS if name.endswith("_clip_accumulate")}
DATA = {"cp2_padded_llama": "padded_data", "cp2_packed_llama": "packed_data", "cp2_window_mistral": "plain_data",
        "cp2_documents": "document_data"}  # tests/cp_mask_models.py's; the others train on token_data


def _data(name: str):
    if name not in DATA:
        return token_data(size=96)
    from tests import cp_mask_models
    return getattr(cp_mask_models, DATA[name])(size=96)


def _model_parallel():
    from lightning.pytorch.strategies import ModelParallelStrategy
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def run(name: str, out: Path) -> None:
    build, strategy = LAYOUTS[name]
    print(f"host_sync_script: {name}", flush=True)  # a failed launch's log shows which layout failed
    pl.seed_everything(0, verbose=False)
    counter = CountSteps(first=3, last=8)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD,
                         strategy=strategy(), max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, log_every_n_steps=50, callbacks=[counter], **TRAINER.get(name, {}))
    module = build()
    trainer.fit(module, DataLoader(_data(name), batch_size=4))
    loss = trainer.callback_metrics.get("train_loss")
    record = dict(name=name, rank=trainer.global_rank, counts=counter.per_step(),
                  loss=None if loss is None else float(loss))
    (out / f"{name}-rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1])
    for layout in sys.argv[2:]:
        run(layout, target)
