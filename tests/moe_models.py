"""Mixture-of-experts language models for the expert-parallel tests (issue #30); none knows about lightning_4d.

- ``HandMoELM``: the common hand-written form: each block's MoE holds an ``nn.ModuleList`` of gated expert MLPs
  and a top-k linear router, and loops over the experts (dropless: every routed token is computed).
- ``HFMoELM``: Hugging Face ``Qwen2MoeForCausalLM`` (shared expert beside the routed ones),
  ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` or ``DeepseekV3ForCausalLM`` (latent attention, a first dense
  layer, a shared expert, group-limited routing with a bias) from a tiny config: experts as fused 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj``
  [E, H, I], run by the config's ``experts_implementation``; ``router_aux`` turns on ``output_router_logits``
  (the model's load-balancing ``aux_loss`` times ``router_aux_loss_coef`` is added to the language-model loss).

The tiny configs route every token to ``top_k`` of 4 (or 8) experts with a random router, so a batch of 8 x 16
tokens reaches every expert (tests/test_expert_parallel.py checks it): each expert trains, and a wrong
placement of any one shows in the weights.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tests.lm_models import VOCAB, _CausalLM, sgd


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedExpertMLP(nn.Module):
    """An expert with one gate|up projection (Phi-3's form), whose rows tensor parallelism reorders per rank."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """Softmax router, top-k, weights renormalized over the chosen experts; a loop over the experts."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int, fused: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList((FusedExpertMLP if fused else ExpertMLP)(hidden, inner) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(shape)


class SigmoidMoE(MoE):
    """A router that scores each expert by a sigmoid (DeepSeek-V3's choice), not a softmax: another routing than
    the common form, which expert parallelism must refuse rather than replace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.sigmoid(self.router(x)).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(shape)


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, inner: int, experts: int, top_k: int, sigmoid: bool = False,
                 fused: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mix = nn.Linear(hidden, hidden, bias=False)  # a token-wise dense layer beside the experts
        self.moe = (SigmoidMoE if sigmoid else MoE)(hidden, inner, experts, top_k, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(x)
        return x + self.moe(self.norm(x))


class HandMoELM(_CausalLM):
    def __init__(self, vocab_size: int = VOCAB, hidden: int = 16, inner: int = 32, layers: int = 2,
                 experts: int = 4, top_k: int = 2, sigmoid: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(MoEBlock(hidden, inner, experts, top_k, sigmoid, fused) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def hf_moe_config(kind: str = "qwen2_moe", vocab_size: int = VOCAB, hidden: int = 16, layers: int = 2,
                  experts: int = 4, top_k: int = 2, router_aux: bool = False,
                  experts_implementation: str = "eager", inner: Optional[int] = None):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=top_k,
                  output_router_logits=router_aux, router_aux_loss_coef=0.1, bos_token_id=0, eos_token_id=1,
                  pad_token_id=None, attn_implementation="sdpa", experts_implementation=experts_implementation)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=2 * hidden,
                                           shared_expert_intermediate_size=2 * hidden, intermediate_size=2 * hidden,
                                           norm_topk_prob=True, **common)
    if kind == "mixtral":
        return transformers.MixtralConfig(num_local_experts=experts, intermediate_size=inner or 2 * hidden,
                                          router_jitter_noise=0.0, **common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=2 * hidden, head_dim=4,
                                           intermediate_size=2 * hidden, norm_topk_prob=True, **common)
    if kind == "deepseek_v3":  # multi-head latent attention, a first dense layer, a shared expert, grouped routing
        common.update(num_key_value_heads=4)
        return transformers.DeepseekV3Config(n_routed_experts=experts, moe_intermediate_size=2 * hidden,
                                             intermediate_size=2 * hidden, n_group=1, topk_group=1, n_shared_experts=1,
                                             first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8,
                                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **common)
    raise ValueError(f"kind={kind!r}: use 'qwen2_moe', 'mixtral', 'qwen3_moe' or 'deepseek_v3'")


class HFMoELM(_CausalLM):
    def __init__(self, kind: str = "qwen2_moe", router_aux: bool = False, **config) -> None:
        super().__init__()
        import transformers

        self.config = hf_moe_config(kind, router_aux=router_aux, **config)
        self.model = transformers.AutoModelForCausalLM.from_config(self.config)
        # transformers' initializer leaves a router at zeros in some families: give every router random weights,
        # so that routing depends on the token (and on training)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith("gate.weight") and p.dim() == 2:
                    p.normal_(0.0, 0.5)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch):
        input_ids, labels = batch
        if not self.config.output_router_logits:
            return super()._loss(batch)
        out = self.model(input_ids=input_ids)  # labels are shifted in the data already: the loss from the logits
        lm = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), labels.reshape(-1))
        return lm + self.config.router_aux_loss_coef * out.aux_loss


def hand_moe(**kwargs) -> HandMoELM:
    return HandMoELM(**kwargs)


def adamw(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2)


__all__ = ["ExpertMLP", "FusedExpertMLP", "HFMoELM", "HandMoELM", "MoE", "SigmoidMoE", "adamw", "hf_moe_config", "sgd"]
