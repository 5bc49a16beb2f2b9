"""Tensor, sequence and vocabulary parallelism for modules whose code stays unchanged.

``plan_tensor_parallel`` inspects a module without communicating and returns a
``TensorParallelPlan``; ``apply_tensor_parallel`` shards the module in place over a
1-D tensor-parallel ``DeviceMesh`` with DTensor ``parallelize_module`` styles.

How an unchanged module keeps computing the same function
---------------------------------------------------------
* Attention and MLP *regions* are found by child names and checked by shapes:
  q/k/v (or a fused qkv) column-wise, output projection row-wise; up/gate column-wise,
  down row-wise.  Inside a region activations are plain local tensors holding this
  rank's heads (or this rank's slice of the intermediate size).
* An attention region runs as if it were a 1/tp-wide copy of itself: integer size
  attributes (``n_head``, ``num_key_value_heads``, ``n_embd``, ``split_size``, ...) on
  the module, and on a private copy of its ``config`` object, are divided by tp, and
  the module's forward sees its hidden-state argument narrowed to hidden/tp columns
  while its projections still read the full activation.  So code such as
  ``B, T, C = x.size(); q.view(B, T, self.n_head, C // self.n_head)`` works as is.
* A fused qkv weight (GPT-2 ``Conv1D``, nanoGPT, litgpt GQA, Phi-3 ``qkv_proj``) or
  gate|up weight (Phi-3 ``gate_up_proj``) is permuted once so that every rank's
  contiguous shard holds its own heads of q, k and v (its half of gate and up); state-dict
  hooks translate to and from the original layout, so checkpoints stay
  interchangeable with the single-device module.  Optimizer state of such a weight
  stays in the permuted layout, which depends on tp.
* Because a wrong head count trains a different model without failing,
  ``TensorParallelSelfCheck`` compares one sharded block of each type against an
  unsharded copy on the first real batch.

Vocabulary
----------
The token embedding is sharded row-wise (by vocabulary) and the LM head
column-wise.  Tied embedding/head weights stay one parameter.  With
``loss_parallel=True`` the head's logits stay sharded on the vocabulary dim only
inside ``tensor_parallel_context``: there, ``F.cross_entropy`` /
``nn.CrossEntropyLoss`` on them is computed vocabulary-parallel (the full logits are
never gathered) and returns a plain loss, while any other use of the logits
transparently sees gathered, plain logits.  So no detection of the user's loss is
needed, and outside the context (callbacks, generation) the head returns plain,
gathered logits.

Sequence parallelism (``sequence_parallel=True``)
-------------------------------------------------
Between regions activations are DTensors sharded on dim 1 (batch-first
``[B, T, C]`` is assumed): norms run on sequence shards (``SequenceParallel``), each
region all-gathers its input once and its row-wise projection reduce-scatters its
output (Megatron-style).  Code between regions sees global shapes, and plain tensors
it mixes in (masks, position tables) are treated as replicated.  Parameters outside
regions become replicated DTensors whose gradients are all-reduced after
accumulation.

Random state and dropout
------------------------
All tensor-parallel ranks start from the same seed.  Dropout on replicated
activations (everything between regions without sequence parallelism) draws the
same mask on every rank, as it must.  Dropout on sequence-sharded DTensor
activations goes through DTensor's RNG tracker, which on CUDA gives each shard its
own offset of one shared stream; on CPU DTensor warns that it has no tracker and
every shard draws from the same local stream.  Dropout inside a region (attention
probabilities) acts on each rank's own heads with the same local stream, so the
heads of rank 0 and rank 1 draw identical masks: still a valid dropout for every
head, but masks are correlated across the ranks' head groups, unlike on one device.

Integration (what a strategy calls)
-----------------------------------
1. setup: ``plan = plan_tensor_parallel(module, tp, tp_plan, ...)`` (raises
   ``ValueError`` before any collective; log ``plan.describe()``), then, after moving the
   module to its device, ``check = apply_tensor_parallel(module, mesh["tp"], plan)``.  With
   pipeline parallelism, plan on the whole model and apply the same plan to each stage, passing
   ``held=`` the FQNs of the modules the rank's stages hold (from the pipeline plan).
   With sequence parallelism a stage's output is a DTensor sharded on dim 1; a plain stage
   input is read as replicated.
2. around every training/validation/test/predict step *and* around backward:
   ``with tensor_parallel_context(plan): ...``.
3. first training batch: ``check.arm()`` before the forward, ``check.verify()`` after it
   (collective over the tp group; raises ``TensorParallelCheckError``).
4. gradient clipping: ``lightning_4d.numerics.clipping.clip_grad_norm_(params, max_norm, group=pp_group)``.

Modules, one per job
--------------------
``plan`` (the plan's types), ``user_plan`` (a ``tp_plan`` mapping expanded to FQNs), ``discovery``
(``plan_tensor_parallel``), ``styles`` (DTensor parallel styles, Conv1D included), ``adapters`` (peft LoRA
adapters placed with their base layers), ``loss_parallel``
(vocabulary-sharded logits and ``tensor_parallel_context``), ``apply`` (``apply_tensor_parallel`` and its
hooks), ``self_check`` (``TensorParallelSelfCheck``), ``config`` (``TensorParallelConfig``). Clipping over
DTensor, plain and pipeline-split parameters is :mod:`lightning_4d.numerics.clipping`.
"""

from lightning_4d.tensor_parallel.apply import apply_tensor_parallel, unmix_foreach
from lightning_4d.tensor_parallel.config import TensorParallelConfig
from lightning_4d.tensor_parallel.discovery import find_regions, plan_tensor_parallel
from lightning_4d.tensor_parallel.loss_parallel import tensor_parallel_context
from lightning_4d.tensor_parallel.plan import (STYLES, FusedGateUpLayout, FusedQKVLayout, GroupedQKVLayout,
                                              ModuleStyle, Region, TensorParallelPlan)
from lightning_4d.tensor_parallel.self_check import TensorParallelCheckError, TensorParallelSelfCheck, armed_self_check

__all__ = [
    "STYLES",
    "FusedGateUpLayout",
    "FusedQKVLayout",
    "GroupedQKVLayout",
    "ModuleStyle",
    "Region",
    "TensorParallelCheckError",
    "TensorParallelConfig",
    "TensorParallelPlan",
    "TensorParallelSelfCheck",
    "apply_tensor_parallel",
    "armed_self_check",
    "find_regions",
    "plan_tensor_parallel",
    "tensor_parallel_context",
    "unmix_foreach",
]
