"""Fine-tuning models as users write them: a zoo family with its token embedding frozen, and a peft LoRA model
(``peft.get_peft_model``, base frozen) whose optimizer holds only the trainable parameters.

The LoRA factors start random (``init_lora_weights=False``), not with B = 0 as peft's default: then the first
step already trains A and reads B, and a factor placed wrongly under tensor parallelism shows at once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from tests.zoo_models import HFZooLM

# Attention and MLP projections of the zoo's Llama (separate q/k/v) and Phi-3 (fused qkv_proj and gate_up_proj).
LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
LORA_TARGETS["gemma"] = LORA_TARGETS["llama"]  # one key/value head: k_proj and v_proj whole at tp=2
ADAPTER = "default"


class _TrainableOnly(HFZooLM):
    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


class FrozenEmbeddingLM(_TrainableOnly):
    """The zoo's family with ``embed_tokens`` frozen (its LM head stays trainable: the zoo's Llama ties none)."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__(family)
        self.model.get_input_embeddings().weight.requires_grad_(False)


class LoRALM(_TrainableOnly):
    """``get_peft_model`` over the zoo's family: every base weight frozen, LoRA on attention and MLP projections
    (``vocabulary``: also on the token embedding and the LM head; ``use_dora``: DoRA, which tensor parallelism
    refuses)."""

    def __init__(self, family: str = "llama", vocabulary: bool = False, use_dora: bool = False) -> None:
        super().__init__(family)
        import peft

        self.family, self.vocabulary = family, vocabulary
        targets = LORA_TARGETS[family] + (["embed_tokens", "lm_head"] if vocabulary else [])
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                 init_lora_weights=False, use_dora=use_dora)
        self.model = peft.get_peft_model(self.model, config)


class ThawEmbedding(Callback):
    """Unfreezes the token embedding before the second step, as a later fine-tuning phase would."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            pl_module.model.get_input_embeddings().weight.requires_grad_(True)


def trained_lora(family: str, weights: dict[str, torch.Tensor], vocabulary: bool = False) -> LoRALM:
    """A plain ``LoRALM`` holding trained weights (``full_state()`` of a run), e.g. to save its adapter."""
    module = LoRALM(family, vocabulary)
    module.load_state_dict(weights)
    return module


def base_lm(family: str, weights: dict[str, torch.Tensor]) -> HFZooLM:
    """A plain zoo model holding the base weights of a LoRA run (which training leaves as they were)."""
    module = HFZooLM(family)
    prefix, layer = "model.base_model.model.", ".base_layer."
    base = {("model." + key[len(prefix):]).replace(layer, "."): value for key, value in weights.items()
            if key.startswith(prefix) and ".lora_" not in key}
    module.load_state_dict(base)
    return module


class FineTuneProbe(Callback):
    """What a layout did with the frozen parameters, and the adapter ``save_pretrained`` wrote from the full
    state after training (on rank 0; ``full_state`` is collective, so every rank takes it)."""

    def parity_extras(self, trainer) -> dict:
        module = trainer.lightning_module
        frozen = {id(p): name for name, p in module.named_parameters() if not p.requires_grad}
        optimizer = trainer.optimizers[0]
        buckets = trainer.strategy.parallel._buckets.values()
        extras = {
            "frozen": sorted(frozen.values()),
            "frozen_with_grad": [name for name, p in module.named_parameters() if id(p) in frozen and p.grad is not None],
            "frozen_in_optimizer_state": [frozen[id(p)] for p in optimizer.state if id(p) in frozen],
            "frozen_in_buckets": [frozen[id(p)] for b in buckets for bucket in b.buckets for p in bucket.params
                                  if id(p) in frozen],
        }
        plan = trainer.strategy.parallel.tensor_plan
        if plan is not None and plan.adapters:
            extras["adapter_placements"], extras["adapter_forward_collectives"] = _adapters_under_tp(module, plan)
        if isinstance(module, LoRALM):
            weights = trainer.strategy.parallel.full_state()
            if trainer.global_rank == 0:
                extras["adapter"] = _saved_adapter(trained_lora(module.family, weights, module.vocabulary))
        return extras


def _saved_adapter(module: LoRALM) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for the module's peft model, by name."""
    with tempfile.TemporaryDirectory() as directory:
        module.model.save_pretrained(directory)
        return {path.name: path.read_bytes() for path in Path(directory).iterdir() if path.is_file()}


def _adapters_under_tp(module, plan) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """How the first adapted layer of each tensor-parallel style this rank holds placed its base and adapter
    weights, and the collectives one forward of it issues (every rank runs it: a row-wise layer all-reduces)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    placements, collectives = {}, {}
    held = dict(module.named_modules())  # under pipelining, this rank's stage (the same for its tp group)
    for style in ("colwise", "rowwise"):
        layer = next(held[f] for f in plan.adapters if plan.styles[f].style == style and f in held)
        for name, param in layer.named_parameters():
            placements[f"{style}:{name}"] = str(param.placements) if isinstance(param, DTensor) else "plain"
        width = layer.base_layer.weight.to_local().shape[1]  # a row-wise layer reads its shard of the features
        with torch.no_grad(), CommDebugMode() as comm:
            layer(torch.ones(1, 4, width))
        collectives[style] = {str(op): count for op, count in comm.get_comm_counts().items()}
    return placements, collectives
