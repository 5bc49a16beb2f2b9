"""One composition: how a module becomes parallel, in one order, once per module.

:func:`parallelize` takes an unchanged module, the layout's :class:`~lightning_4d.parallel_dims.ParallelMesh`
and the per-dimension options, and applies, in this order:

1. **Plans**, without communicating, so that a module that does not fit fails alike on every rank before any
   collective: the tensor-parallel plan on the whole module (it must see the LM head that the pipeline gives
   to the last stage) and the pipeline plan (which modules each stage holds).
2. **One set of weights**: rank 0's parameters and buffers are broadcast to every rank, as DDP does, so a
   module built without a common seed still trains one model, and tp/pp cut their shards from it; in buckets
   of at most 64 MB, and not at all when a load follows (``loading``). A module built on the meta device is
   checked instead: every meta tensor needs an initializer, else a ValueError on every rank, before any
   collective (:func:`~lightning_4d.composition.materialize.check_initializers`).
3. **Pipeline cut**: this rank keeps only its stages' blocks and the modules around them that it owns.
4. **Device**, then **tensor/sequence parallelism**: the modules this rank holds are sharded over ``tp``.
5. **Context parallelism**: hooks that give position modules global positions and turn attention into
   ring attention while a step runs on sequence shards.
6. **Compile** (``torch.compile``) of each block this rank holds, as steps 3-5 left them.
7. **Activation checkpointing** of those blocks (a recomputed block is laid out like the original). With compile
   it comes before step 6 (torch traces the checkpoint), except under context parallelism, whose interception a
   traced checkpoint cannot enter; where neither works the blocks stay eager, with a warning (docs/compile.md).
8. **Sharded data parallelism** (``dp_shard > 1``): FSDP2 units per block and at the root (under pipelining,
   the modules around the blocks instead), over ``dp_shard x cp`` (HSDP: replicated over ``dp_replicate``),
   wrapping the blocks as steps 3-7 left them; then the pipeline's stage-boundary hooks, outermost.
   Then, for a module built on the meta device, **materialization**: every placement is decided, so each rank
   allocates only what it holds (its stages, tp shards, FSDP shards) and fills it with the module's own
   initializer; non-persistent buffers are recomputed (:mod:`lightning_4d.composition.materialize`).
9. **Metric sync** over the ranks that hold different data.
10. **Gradient synchronisation**, once the optimizers exist (:meth:`ParallelModel.attach_optimizers`):
    bucketed all-reduce over ``dp x cp``, overlapped with backward; with sharding, FSDP's reduce-scatter
    (and HSDP all-reduce) instead, switched on for the last backward before an optimizer step.

The :class:`~lightning_4d.composition.parallel_model.ParallelModel` returned owns everything a training loop needs afterwards: the step (with its
contexts, the pipeline schedule, the tensor-parallel self-check, the compile report), batch sharding,
backward, gradient sync, clipping over the whole model, state dicts and checkpoints, and removal of its
hooks. It is attached to the module, so parallelizing the same module again (``validate`` after ``fit``, a
second Trainer) returns it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_4d.composition.block_units import (blocks_to_compile, fsdp_blocks, gradient_hooked, held_blocks,
                                                  modules_around_blocks, shared_params, units_around_blocks)
from lightning_4d.composition.materialize import (check_initializers, has_meta_tensors, initialize, materialize,
                                                  move_real_tensors)
from lightning_4d.composition.parallel_model import ParallelModel
from lightning_4d.composition.plans import make_plans
from lightning_4d.composition.weight_agreement import agreed_seed, broadcast_from_rank0
from lightning_4d.context_parallel import ContextParallelConfig
from lightning_4d.data_parallel import (DEFAULT_BUCKET_MB, ReshardAfterForward, apply_sharding, check_own_units,
                                        own_unit_params, own_units, param_dtype_for)
from lightning_4d.data_parallel.batchnorm import batchnorm_statistics
from lightning_4d.expert_parallel import apply_expert_parallel, replaced_expert_lists
from lightning_4d.memory.activation_checkpointing import (ActivationCheckpointConfig, apply_activation_checkpointing,
                                                          disable_kv_caches)
from lightning_4d.memory.compile import CompileConfig, apply_compile, eager_reason
from lightning_4d.numerics import head_loss
from lightning_4d.numerics.clipping import install_clipping
from lightning_4d.parallel_dims import ParallelMesh
from lightning_4d.pipeline import PipelineConfig, PipelineRunner
from lightning_4d.tensor_parallel import TensorParallelConfig, apply_tensor_parallel

_ATTRIBUTE = "_lightning_4d_parallel"


def check_before_launch(module: nn.Module, mesh_dims: Any, *, pipeline: PipelineConfig, tensor: TensorParallelConfig,
                        user_parallelized: bool) -> None:
    """Before any process group, on every rank: a module the pipeline cannot cut, or that sharding or expert
    parallelism refuses (its plans are made again, on the same module, in :func:`parallelize`; skipped for one
    already parallelized or whose ``configure_model`` lays it out first, ``user_parallelized``)."""
    if (mesh_dims.pp_enabled or mesh_dims.dp_shard_enabled or mesh_dims.ep_enabled) and parallelized(
            module) is None and not user_parallelized:
        make_plans(module, mesh_dims, pipeline=pipeline, tensor=tensor)


def parallelized(module: nn.Module) -> Optional[ParallelModel]:
    """The :class:`ParallelModel` ``module`` was made into, or None."""
    return module.__dict__.get(_ATTRIBUTE)


def parallelize(module: nn.Module, mesh: ParallelMesh, device: torch.device, *, pipeline: PipelineConfig,
                tensor: TensorParallelConfig, context: ContextParallelConfig,
                activation_checkpointing: ActivationCheckpointConfig = ActivationCheckpointConfig(),
                compile: CompileConfig = CompileConfig(), bucket_mb: float = DEFAULT_BUCKET_MB,
                reshard_after_forward: ReshardAfterForward = "auto", reduce_scatter_every_batch: bool = False,
                param_dtype: Optional[torch.dtype] = None, loss_normalization: str = "tokens",
                loading: bool = False, shard_units: str = "blocks", fuse_lm_loss: bool = True) -> ParallelModel:
    """Make ``module`` parallel in place over ``mesh`` (see the module docstring for the order); collective.

    ``reshard_after_forward``, ``reduce_scatter_every_batch``, ``param_dtype`` (compute dtype of FSDP's mixed
    precision) and ``shard_units`` only matter with ``dp_shard > 1`` (see :mod:`lightning_4d.data_parallel.fsdp`).
    ``loss_normalization``: how token-mean losses are weighted over the ranks (:mod:`lightning_4d.numerics.token_losses`).
    ``fuse_lm_loss``: the LM head's cross entropy is computed in chunks from the head's input
    (:mod:`lightning_4d.numerics.head_loss`).
    ``loading``: the caller loads every parameter and persistent buffer right after (``init_from``): rank 0's
    weights are not broadcast, and a meta-built module gets storage but only its non-persistent buffers are
    initialized (:mod:`lightning_4d.composition.materialize`).

    Idempotent per module: a module parallelized already with the same options gets its :class:`ParallelModel`
    back (with its hooks re-installed if they were removed); other options raise a ValueError.
    """
    options = dict(dims=mesh.dims, pipeline=pipeline, tensor=tensor, context=context, bucket_mb=bucket_mb,
                   activation_checkpointing=activation_checkpointing, compile=compile,
                   reshard_after_forward=reshard_after_forward,
                   reduce_scatter_every_batch=reduce_scatter_every_batch, param_dtype=param_dtype,
                   loss_normalization=loss_normalization, shard_units=shard_units, fuse_lm_loss=fuse_lm_loss)
    existing = parallelized(module)
    if existing is not None:
        if existing.options != options:
            raise ValueError(f"This {type(module).__name__} was already parallelized with other options"
                             f" ({existing.options}); a sharded or cut module cannot be laid out again. Use the same"
                             " strategy options for fit, validate, test and predict, or a freshly built module.")
        existing.install_hooks()
        return existing
    if mesh.dims.dp_shard_enabled and mesh.dims.pp_enabled and reshard_after_forward is True:
        raise ValueError(f"reshard_after_forward=True with dp_shard={mesh.dims.dp_shard} and pp={mesh.dims.pp}: under"
                         " pipelining each stage's blocks stay gathered for the whole step (every micro-batch would"
                         " gather them again, and zero-bubble schedules need them between the two halves of a"
                         " backward). Use reshard_after_forward='auto' or False, which mean that under pp.")
    plans = make_plans(module, mesh.dims, pipeline=pipeline, tensor=tensor)
    lm_head = head_loss.find_lm_head(module) if fuse_lm_loss else None  # on the whole module, before the cut
    units = own_units(module)  # fully_shard applied by the module's configure_model: left as it is
    if units:
        check_own_units(units, module, mesh.dims.pp, mesh.dims.cp, mesh.dims.ep)
    frozen = frozenset(name for name, p in module.named_parameters() if not p.requires_grad)
    meta = has_meta_tensors(module)
    if meta:  # on the whole module, before any collective: the same refusal on every rank
        check_initializers(module, loading)
    if not loading:
        broadcast_from_rank0(module, device)
    runner = PipelineRunner(module, plans.pipeline, mesh, device) if plans.pipeline is not None else None
    if meta:
        move_real_tensors(module, device)
    else:
        module.to(device)
    self_check = None
    if plans.tensor is not None:
        held = plans.pipeline.held_modules(mesh.local_rank("pp")) if plans.pipeline is not None else None
        self_check = apply_tensor_parallel(module, mesh.mesh["tp"], plans.tensor, self_check=tensor.self_check,
                                           held=held)
    parallel = ParallelModel(module, mesh, device, plans, runner, self_check, options)
    if lm_head is not None:  # after tp (its column-wise style passes deferred logits), before FSDP shards the weight
        styled = plans.tensor is not None and plans.tensor.enabled and lm_head in plans.tensor.styles
        parallel.head_loss = head_loss.install(module, lm_head, styled)
        forwards_first = plans.pipeline is not None and plans.pipeline.config.spec.forwards_first
        microbatches = plans.pipeline.config.num_microbatches if plans.pipeline is not None else 1
        if parallel.head_loss is not None:
            parallel.head_loss.schedule(forwards_first, microbatches)
        whole = head_loss.whole_logits_elements(forwards_first, microbatches)
        rank_zero_info(head_loss.describe(lm_head, module, styled, whole))
    if mesh.dims.ep_enabled:  # after tp, before compile, checkpointing and FSDP: experts split over ep
        parallel.expert_params, parallel.expert_dispatch = apply_expert_parallel(module, mesh.experts)
        replaced = replaced_expert_lists(module)
        if parallel._self_check is not None and replaced:  # tp's copies of hand-written experts ep replaced
            targets = parallel._self_check.targets
            for fqn in [fqn for fqn in targets if any(fqn.startswith(r + ".") for r in replaced)]:
                del targets[fqn]
            if not targets:
                parallel._self_check = None
    parallel.install_hooks()
    # The checkpoint goes inside the compiled block (torch traces it), except under context parallelism (see 7.).
    compile_outside = not mesh.dims.cp_enabled
    parallel.eager_reason = eager_reason(compile, activation_checkpointing, mesh.dims.cp, mesh.dims.tp)
    if parallel.eager_reason is not None:
        rank_zero_warn(f"compile=True, but the blocks run eagerly: {parallel.eager_reason}")
        compile = CompileConfig()
    if compile.enabled and not compile_outside:
        parallel.compiled = apply_compile(blocks_to_compile(module, plans.pipeline, pipeline), compile)
    if activation_checkpointing.enabled:
        cached = disable_kv_caches(module)
        if cached:
            rank_zero_info(f"activation_checkpointing={activation_checkpointing.mode!r}: config.use_cache=False on"
                           f" {', '.join(cached)} (a recomputed layer would add its keys and values to the cache again).")
        parallel.checkpointed_blocks = apply_activation_checkpointing(
            held_blocks(module, plans.pipeline, pipeline), activation_checkpointing,
            parallel.recompute_context if mesh.dims.cp_enabled else None)
    if compile.enabled and compile_outside:
        parallel.compiled = apply_compile(blocks_to_compile(module, plans.pipeline, pipeline), compile)
    parallel.own_sharded = own_unit_params(module)
    if units:
        rank_zero_info(f"{type(module).__name__}.configure_model applied fully_shard ({len(units)} units): left as it"
                       " is, with the mesh and mixed precision it chose; FSDP reduces those parameters' gradients.")
    elif mesh.dims.dp_shard_enabled:
        parallel.replicated_params = gradient_hooked(module, parallel.tensor_plan)
        outside, around = None, []
        if runner is not None:
            outside, kept = units_around_blocks(module, runner.split.path, runner.split.ends())
            parallel.replicated_params += [p for p in kept if all(p is not q for q in parallel.replicated_params)]
        elif shard_units == "modules":
            around = modules_around_blocks(module, pipeline)
        parallel.sharded = apply_sharding(module, fsdp_blocks(module, plans.pipeline, pipeline), mesh.sharding_mesh(),
                                          reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                                          ignored_params={*parallel.replicated_params, *parallel.expert_params},
                                          outside=outside, every_batch=reduce_scatter_every_batch, around=around,
                                          skip=shared_params(module))
    if parallel.head_loss is not None and parallel.sharded is not None:
        _keep_head_gathered(parallel, reshard_after_forward, runner is not None)
    if meta:  # every placement is decided: allocate what this rank holds, then fill it
        owners = materialize(module, device)
        initialize(module, owners, device, agreed_seed(device), loading=loading)
    if runner is not None:
        runner.hook_boundaries()
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric) and metric.process_group is None:
            metric.process_group = parallel.metric_group
    parallel.frozen = frozen
    thawed = [name for name, p in module.named_parameters() if p.requires_grad and name in frozen]
    if thawed:  # a style that re-registers a parameter without its requires_grad would train a frozen weight
        raise RuntimeError(f"lightning_4d made the frozen parameters {thawed[:3]} trainable while parallelizing"
                           f" {type(module).__name__}: a bug, please report it with this message.")
    module.__dict__[_ATTRIBUTE] = parallel
    return parallel


def parallelize_for_trainer(module: Any, mesh: ParallelMesh, device: torch.device, options: dict[str, Any],
                            precision_plugin: Any, init_from: Optional[str], init_from_prefix: Optional[str], *,
                            sync_batchnorm: bool) -> ParallelModel:
    """:func:`parallelize` for a Lightning module (``options``: its keyword arguments), then what Lightning's loop
    needs of the result: clipping on the precision plugin by the whole model's norm, BatchNorm statistics over the
    split batch (``sync_batchnorm``: ``Trainer(sync_batchnorm=True)``), and the ``init_from`` weights loaded. With
    ``init_from`` (strict) that load fills every weight: parallelize neither broadcasts rank 0's nor initializes a
    meta-built module's (only what no checkpoint holds: non-persistent buffers)."""
    first = parallelized(module) is None
    loading = init_from is not None and module.strict_loading
    parallel = parallelize(module, mesh, device, **options, loading=loading,
                           param_dtype=param_dtype_for(str(getattr(precision_plugin, "precision", ""))))
    if first and rank_zero_only.rank == 0 and parallel.describe():  # the rank that prints it builds it
        rank_zero_info(parallel.describe())
    dims = mesh.dims
    install_clipping(precision_plugin, parallel, whole_model=dims.tp_enabled or dims.pp_enabled
                     or dims.dp_shard_enabled or dims.ep_enabled)
    batchnorm_statistics(module, {"dp": dims.dp * dims.dp_shard, "cp": dims.cp}, mesh.group("dp_cp"), sync_batchnorm,
                         warn=first)
    if init_from is not None:
        parallel.load_weights(init_from, strict=module.strict_loading, prefix=init_from_prefix)
    return parallel


def _keep_head_gathered(parallel: ParallelModel, reshard_after_forward: ReshardAfterForward,
                        pipelined: bool) -> None:
    """The fused LM-head loss computes the head's logits after the head's forward returns, from its gathered
    weight: an FSDP unit of its own keeps it gathered until its backward (which follows at once: the head is the
    forward's last module and the backward's first); a root unit that frees it after every forward
    (``reshard_after_forward=True``) leaves the head unfused, and says so."""
    head = parallel.head_loss.head
    if isinstance(head, FSDPModule):
        head.set_reshard_after_forward(False)
    elif reshard_after_forward is True and not pipelined:
        name = parallel.head_loss.name
        parallel.head_loss.remove()
        parallel.head_loss = None
        rank_zero_info(f"fuse_lm_loss: the LM head {name} is not fused: reshard_after_forward=True"
                       " frees the root FSDP unit's gathered weights, the head's among them, when the forward"
                       " returns, before the loss computes the logits. reshard_after_forward='auto' (the default)"
                       " keeps the root gathered and fuses the head.")
