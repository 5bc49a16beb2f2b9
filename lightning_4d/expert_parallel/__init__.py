"""Expert parallelism: each mixture-of-experts layer's routed experts split over ``ep`` ranks (E/ep whole experts
each), tokens sent to the rank holding their expert and back: fused experts by fixed-size gathers, grouped
matmuls and a reduce-scatter (the host never waits), hand-written ones by an all-to-all of counts, then of
tokens. The router, shared experts and everything else stay as the other dimensions left them.

Which ranks form an expert group: ``ep`` borrows from the ranks that see different tokens, ``dp x cp`` (every
data-parallel rank, replicas and shards, and the context-parallel ranks), never from tp or pp. Each rank keeps
its own batch (the data sampler does not change); its tokens visit the ep group's experts and come back, so
every expert sees exactly the tokens one process would route to it. The groups are consecutive blocks of the
``dp x cp`` coordinate (ranks that are neighbours on a node); the ranks at the same position of every group hold
the same experts (the ``ep_replica`` group), over which expert gradients are averaged.

Gradients: an expert's gradient on its rank already sums what every rank of its group sent it, so it is scaled
by 1/ep and averaged over ``ep_replica`` only (not over ``dp x cp``, whose ranks hold other experts); the other
parameters are reduced as before. Expert weights are DTensors ``Shard(0)`` on the ep mesh (checkpoints reshard
ep=2 -> ep=1 like any DTensor); with ``dp_shard`` they stay out of FSDP.

Models: transformers' fused 3-D experts (grouped matmuls where a probe shows they compute what the module's own
forward does, else its own ``experts_implementation`` on the rows an all-to-all brought), and a
hand-written MoE (an ``nn.ModuleList`` of experts, a softmax top-k router) whose forward a probe batch shows to be
that form: it is routed by lightning_4d, its experts stacked per parameter (``StackedExperts``).

Modules: ``config`` (sizes and refusals before any collective), ``dispatch`` (the two token exchanges),
``apply`` (the experts' weights split, their forward and dispatch set).
"""

from lightning_4d.expert_parallel.apply import apply_expert_parallel, replaced_expert_lists
from lightning_4d.expert_parallel.config import check_ep_layout, check_ep_model, check_ep_size
from lightning_4d.expert_parallel.dispatch import AllToAllDispatch, GatheredDispatch

__all__ = ["AllToAllDispatch", "GatheredDispatch", "apply_expert_parallel", "check_ep_layout", "replaced_expert_lists", "check_ep_model", "check_ep_size"]
