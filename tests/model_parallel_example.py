"""A LightningModule written for Lightning's ``ModelParallelStrategy``, in the shape of Lightning's
``examples/pytorch/tensor_parallel`` (which no package ships, so it is rebuilt here at a tiny size):

- a Llama 3 (``tok_embeddings``, blocks in an ``nn.ModuleDict`` of ``attention.wq/wk/wv/wo`` and
  ``feed_forward.w1/w2/w3``, RMS norms, a complex ``freqs_cis`` buffer, ``init_weights`` and
  ``reset_parameters``) whose attention reads its head counts from attributes that the plan divides;
- ``parallelize(model, device_mesh)``: the example's plan on ``device_mesh["tensor_parallel"]`` (vocabulary-
  sharded embedding, sequence-parallel norms, colwise/rowwise projections, and the output layer as Lightning's
  master ships it: ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)``,
  logits left a vocabulary-sharded DTensor for ``loss_parallel()``, so the loss is a DTensor too; the 2.4-era
  file had ``output_layouts=Replicate()``), then ``checkpoint_wrapper`` and ``fully_shard`` per block and at the
  root on ``device_mesh["data_parallel"]``;
- the module: ``configure_model`` calls it, ``on_train_start`` calls ``init_weights``, the loss and the backward
  run inside torch's ``loss_parallel()``, AdamW with ``foreach=True``; built under
  ``trainer.init_module(empty_init=True)`` (``Case.empty_init``).

The example pins bf16 parameters in its ``MixedPrecisionPolicy``; ``param_dtype`` keeps fp32 for parity tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.data import Dataset

from lightning_4d import FourDStrategy


@dataclass
class Args:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    hidden: int = 64
    max_seq_len: int = 32
    eps: float = 1e-5
    theta: float = 10000.0


def rotations(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """``e^{i * position * frequency}`` for every position and frequency pair: complex64 ``[length, head_dim/2]``."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * cis[: x.size(1)].view(1, x.size(1), 1, -1)
    return torch.view_as_real(turned).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = rotate(q, cis), rotate(k, cis)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=std)


class FeedForward(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden, bias=False)
        self.w2 = nn.Linear(args.hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=std)
        nn.init.trunc_normal_(self.w3.weight, std=std)


class Block(nn.Module):
    def __init__(self, layer_id: int, args: Args) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(args), FeedForward(args)
        self.attention_norm, self.ffn_norm = RMSNorm(args.dim, args.eps), RMSNorm(args.dim, args.eps)
        self.std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)


class Transformer(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._rotations(), persistent=True)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def _rotations(self) -> torch.Tensor:
        return rotations(self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.theta)

    def reset_parameters(self) -> None:
        with torch.device(self.freqs_cis.device):
            self.freqs_cis = self._rotations()

    def init_weights(self) -> None:
        with torch.device(self.freqs_cis.device):
            self.freqs_cis = self._rotations()
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        return self.output(self.norm(h))


def parallelize(model: Transformer, device_mesh, param_dtype: torch.dtype = torch.float32) -> Transformer:
    """The example's: tensor parallelism on ``tensor_parallel``, then activation checkpointing and FSDP2 on
    ``data_parallel``."""
    dp_mesh, tp_mesh = device_mesh["data_parallel"], device_mesh["tensor_parallel"]
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            "norm": SequenceParallel(),
            "layers.0": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                           use_local_output=True),
        })
        for block in model.layers.values():
            block.attention.n_heads //= tp_mesh.size()
            block.attention.n_kv_heads //= tp_mesh.size()
            parallelize_module(block, tp_mesh, {
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "attention_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
                "ffn_norm": SequenceParallel(),
            })
    if dp_mesh.size() > 1:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer_id, block in model.layers.items():
            block = checkpoint_wrapper(block)
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=int(layer_id) < len(model.layers) - 1)
            model.layers[layer_id] = block
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


class Llama3(pl.LightningModule):
    """The example's LightningModule (its steps, optimizer and hooks)."""

    def __init__(self, args: Args | None = None) -> None:
        super().__init__()
        self.model_args = args or Args()
        self.model = Transformer(self.model_args)

    def configure_model(self) -> None:
        parallelize(self.model, device_mesh=self.device_mesh)

    def on_train_start(self) -> None:
        self.model.init_weights()

    def training_step(self, batch):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs):
        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)


class FromFixedWeights(Llama3):
    """The example's module as the tests train it: after its own ``init_weights`` it loads ``starting_weights()``
    (whatever its DTensor layout), so that every strategy and layout starts from the same weights; it logs its loss
    (synced over the replicas, as a ModelParallelStrategy user logs a loss to compare); with ``masked`` targets
    below 16 are ignored (``-100``), a different number on each rank, which token losses weigh as one process."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.masked = masked

    def on_train_start(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.trainer.global_step > 0:  # resumed: the checkpoint's weights stand (the example would re-init them)
            return
        super().on_train_start()
        set_model_state_dict(self.model, starting_weights(), options=StateDictOptions(full_state_dict=True))

    def training_step(self, batch):
        if self.masked:
            inputs, labels = batch[:, :-1], batch[:, 1:].masked_fill(batch[:, 1:] < 16, -100)
            output = self.model(inputs)
            with loss_parallel():
                loss = F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))
        else:
            loss = super().training_step(batch)
        logged = loss
        if not isinstance(self.trainer.strategy, FourDStrategy) and isinstance(loss, DTensor):
            logged = loss.detach().full_tensor()  # ModelParallelStrategy all-reduces a logged DTensor as a tensor
        self.log("train_loss", logged, sync_dist=True)
        return loss


class Automatic(FromFixedWeights):
    """The same module with ``configure_model`` removed: the strategy's automatic plan parallelizes it."""

    configure_model = pl.LightningModule.configure_model


def example(plan: str = "own", masked: bool = False) -> FromFixedWeights:
    """``plan="own"``: the example's ``configure_model``; ``"automatic"``: without it."""
    return (FromFixedWeights if plan == "own" else Automatic)(masked=masked)


class RandomTokens(Dataset):
    """The example's data: random token sequences (one more token than the model reads)."""

    def __init__(self, vocab_size: int = 64, length: int = 17, size: int = 64, seed: int = 0) -> None:
        self.tokens = torch.randint(vocab_size, (size, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


def random_tokens(train: bool = True) -> RandomTokens:
    return RandomTokens(seed=0 if train else 1)


def starting_weights() -> dict[str, torch.Tensor]:
    """The weights every run starts from: the model built whole on one process with a fixed seed."""
    with torch.random.fork_rng():
        torch.manual_seed(7)
        return Transformer(Args()).state_dict()



class MeshNames(Callback):
    """Records the mesh and placements of the LM head's weight, and how many FSDP units the module holds."""

    def parity_extras(self, trainer):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        module = trainer.lightning_module
        weight = module.model.output.weight
        return {"head_mesh": list(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor) else None,
                "head_placements": [str(p) for p in weight.placements] if isinstance(weight, DTensor) else None,
                "fsdp_units": sum(isinstance(m, FSDPModule) for m in module.modules())}
