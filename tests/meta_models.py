"""Models built on the meta device, for the meta-init tests (tests/test_meta_init.py); none knows about
lightning_4d.

- ``MetaLlama``: the tiny Hugging Face Llama of :class:`tests.lm_models.HFCausalLM`, built in ``configure_model``
  under ``trainer.init_module(empty_init=True)``: on the meta device under FourDStrategy; in one process
  (Lightning's single-device strategy) real but uninitialized, then filled from ``weights``, as a user loads
  them in one process.
- ``handed_over_llama``: the same model built on the meta device before ``fit`` (or whole, then loaded).
- ``NoInitializer``: a model with a parameter no initializer fills (its module defines no reset_parameters).
- ``InitProbe``: a callback that records, on every rank, each parameter's local shard with the shard it is,
  and the rotary tables against a freshly built rotary module's.
"""

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor

from tests.lm_models import VOCAB, HFCausalLM, _CausalLM

CONFIG = dict(vocab_size=VOCAB, hidden=32, layers=4, heads=4, kv_heads=2)


def llama_config(kv_heads: int = CONFIG["kv_heads"]):
    import transformers

    c = dict(CONFIG, kv_heads=kv_heads)
    return transformers.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden"], intermediate_size=2 * c["hidden"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        max_position_embeddings=64, attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=None)


def whole_llama_state(path: str, seed: int = 7) -> None:
    """A whole-built model's weights as a plain state_dict file (what ``init_from`` loads)."""
    torch.manual_seed(seed)
    torch.save(HFCausalLM(**CONFIG).state_dict(), path)


class MetaLlama(_CausalLM):
    def __init__(self, weights: str = "", kv_heads: int = CONFIG["kv_heads"]):
        super().__init__()
        self.weights, self.kv_heads = weights, kv_heads
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        import transformers

        with self.trainer.init_module(empty_init=True):
            self.model = transformers.LlamaForCausalLM(llama_config(self.kv_heads))
        if self.weights and not self.model.lm_head.weight.is_meta:  # one process: load as a user does
            self.load_state_dict(torch.load(self.weights, weights_only=True))

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def meta_llama(weights: str = "", kv_heads: int = CONFIG["kv_heads"]) -> MetaLlama:
    return MetaLlama(weights, kv_heads)


def handed_over_llama(weights: str, meta: bool = True) -> HFCausalLM:
    """The tiny Llama built before ``fit`` on the meta device (``meta``), as a user hands it over; or built whole
    and loaded from ``weights``, as one process does."""
    if meta:
        with torch.device("meta"):
            return HFCausalLM(**CONFIG)
    module = HFCausalLM(**CONFIG)
    module.load_state_dict(torch.load(weights, weights_only=True))
    return module


class Gain(nn.Module):
    """A learned per-channel gain with no reset_parameters: nothing can initialize it on the meta device."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.gain


class NoInitializer(_CausalLM):
    def configure_model(self):
        if hasattr(self, "body"):
            return
        with torch.device("meta"):
            self.embed = nn.Embedding(VOCAB, 32)
            self.body = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), Gain(32)) for _ in range(2)])
            self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.body:
            x = block(x)
        return self.head(x)


def no_initializer() -> NoInitializer:
    return NoInitializer()


class InitProbe(Callback):
    """At the start of training (after setup), every rank's local shard of each parameter, keyed by which shard
    it is, and the largest difference of its rotary tables from a freshly built rotary module's; rank 0 gets
    every rank's (``parity_extras``)."""

    def __init__(self):
        self.ranks = None

    def on_train_start(self, trainer, pl_module):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        from lightning_4d.composition.materialize import shard_key

        shards = {}
        for name, p in pl_module.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            shards[name] = (shard_key(p), local.detach().cpu().clone())
        fresh = LlamaRotaryEmbedding(llama_config())
        rotary = pl_module.model.model.rotary_emb
        tables = {name: float((getattr(rotary, name).cpu() - getattr(fresh, name)).abs().max())
                  for name in ("inv_freq", "original_inv_freq")}
        mine = {"rank": dist.get_rank(), "shards": shards, "rotary": tables}
        self.ranks = [None] * dist.get_world_size()
        dist.all_gather_object(self.ranks, mine)

    def parity_extras(self, trainer):
        return {"init_probe": self.ranks}
