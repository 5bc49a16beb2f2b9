"""``FourDStrategy``: Lightning hooks translated into the per-dimension components.

The strategy holds no parallel mechanics of its own. It resolves and validates the layout
(:class:`~lightning_4d.parallel_dims.ParallelDims`), builds the mesh, hands the user's module to the
components, and routes Lightning's collectives to the group where ranks hold different data.
"""

from __future__ import annotations

import difflib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d import checkpoint
from lightning_4d.context_parallel import ContextParallel, check_options as check_context_parallel_options
from lightning_4d.desync import DesyncMonitor
from lightning_4d.faults import attach as attach_fault_tolerance, report_failure
from lightning_4d.telemetry import Telemetry
from lightning_4d.data_parallel import DEFAULT_BUCKET_MB, GradientBuckets
from lightning_4d.parallel_dims import ParallelDims, Size
from lightning_4d.pipeline import PipelineConfig, PipelineRunner, check_splittable
from lightning_4d.resumable_loader import ResumableDataLoader, make_resumable
from lightning_4d.tensor_parallel import (
    TensorParallelPlan,
    TensorParallelSelfCheck,
    apply_tensor_parallel,
    clip_grad_norm_,
    plan_tensor_parallel,
)

DEFAULT_TIMEOUT = timedelta(minutes=10)

# Modules whose initial weights were already broadcast from rank 0.
_broadcast_modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

# The plan each module was sharded with: a later Trainer on the same module finds its plan again.
_tensor_parallel_plans: "weakref.WeakKeyDictionary[torch.nn.Module, TensorParallelPlan]" = weakref.WeakKeyDictionary()


class FourDStrategy(ModelParallelStrategy):
    """Data, tensor/sequence, context and pipeline parallelism for an unchanged LightningModule.

    Args:
        dp: data-parallel replicas; ``"auto"`` takes what is left of the world size after pp, cp and tp.
        pp: pipeline stages.
        cp: context-parallel ranks that split each sequence.
        tp: tensor-parallel ranks that split each layer.
        bucket_mb: size of a gradient all-reduce bucket in megabytes.
        timeout: how long a collective may wait before every rank fails instead of hanging.
        process_group_backend: ``"nccl"``/``"gloo"``; by default chosen from the device.
        init_from: weights to start from, in whatever layout this run uses: a lightning-4d checkpoint
            directory, a Lightning checkpoint file, or a file with a plain ``state_dict``. Loop and optimizer
            state are not restored (that is ``fit(ckpt_path=...)``).
        cp_comm: how context-parallel attention exchanges K/V: ``"ring"`` (P2P, O(L/cp) memory) or ``"allgather"``.
        cp_seq_dim: the sequence dim of the batch's tensors, which context parallelism shards.
        cp_batch_keys: batch entries to shard (``"input_ids"``, ``"0"`` for a tuple's first); ``None``: every
            tensor as long on ``cp_seq_dim`` as the batch's first one.
        cp_position_modules: module FQN globs whose position input gets global positions; ``None``: learned
            position embeddings (``*wpe``, ...) and rotary embeddings with ``position_ids`` found by name.
        cp_buffers: buffer FQN globs of per-position tables (dim 0) swapped for their global rows during a step;
            ``None``: ``cos``, ``sin``, ``freqs_cis``, ... found by name.
        pp_schedule: pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``,
            ``interleaved_zero_bubble``, ``zbv_zero_bubble`` or ``dualpipev``.
        pp_microbatches: micro-batches per batch; ``None``: ``2 * pp``. Every batch must split into equal parts.
        pp_blocks: dotted path of the block list to split (``"model.layers"``); ``None``: the longest list of
            blocks of one type.
        pp_split_points: the block index where each stage but the first begins; ``None``: an even split.
        pp_virtual_stages: stages per rank for ``interleaved_1f1b``, ``looped_bfs`` and
            ``interleaved_zero_bubble`` (default 2); the others fix it.
        tp_plan: how tensor parallelism shards the module: ``"auto"`` (attention, MLP, vocabulary found by
            name and shape), ``"none"``/``None`` (every tp rank holds the whole module), or a mapping of module
            FQN globs (relative to the LightningModule) to ``colwise``/``rowwise``/``sequence_parallel``/
            ``replicate`` or ``{style, input, output, divide}``, merged over the automatic plan. Ignored when
            ``configure_model`` already made DTensor parameters.
        sequence_parallel: keep activations between attention and MLP regions sharded on the sequence dim (dim 1);
            not with ``pp > 1``.
        tp_self_check: on the first training batch, compare one sharded block of each type with an unsharded
            copy and fail naming the block if they differ (a head count that was not divided, ...).
        loss_parallel: cross entropy on the LM head's logits without gathering the vocabulary.
        debug: for the first ``debug_steps`` training steps, check that the ranks of a replica receive identical
            batches, that replicated weights stay bit-identical, and that every rank issues the same collectives
            (each checked before it runs); the first difference is reported by rank and tensor name.
        debug_steps: how many training steps ``debug`` checks.
        telemetry: add the :class:`~lightning_4d.telemetry.Telemetry` callback (tokens/s, MFU, memory,
            communication time per dimension, pipeline bubble), logged through the Trainer's loggers.
        broadcast_buffers: before every training step, broadcast the module's buffers (BatchNorm running
            statistics, ...) from the first rank of each replica group, as DDP does by default.
    """

    strategy_name = "fourd"

    def __init__(
        self,
        dp: Size = "auto",
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        timeout: timedelta = DEFAULT_TIMEOUT,
        process_group_backend: Optional[str] = None,
        init_from: Optional[str] = None,
        cp_comm: Literal["ring", "allgather"] = "ring",
        cp_seq_dim: int = 1,
        cp_batch_keys: Optional[list[Union[str, int]]] = None,
        cp_position_modules: Optional[list[str]] = None,
        cp_buffers: Optional[list[str]] = None,
        pp_schedule: str = "1f1b",
        pp_microbatches: Optional[int] = None,
        pp_blocks: Optional[str] = None,
        pp_split_points: Optional[list[int]] = None,
        pp_virtual_stages: Optional[int] = None,
        tp_plan: Union[str, dict, None] = "auto",
        sequence_parallel: bool = False,
        tp_self_check: bool = True,
        loss_parallel: bool = True,
        debug: bool = False,
        debug_steps: int = 2,
        telemetry: bool = False,
        broadcast_buffers: bool = True,
        **unknown: Any,
    ) -> None:
        if unknown:
            _raise_unknown_arguments(unknown)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number of megabytes (default 25).")
        self._sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        ParallelDims.check_sizes(dp, pp, cp, tp)
        self.bucket_mb = float(bucket_mb)
        self.init_from = init_from
        check_context_parallel_options(cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers)
        self._cp_options = dict(comm=cp_comm, seq_dim=cp_seq_dim, batch_keys=cp_batch_keys,
                                position_modules=cp_position_modules, buffers=cp_buffers)
        self._context_parallel: Optional[ContextParallel] = None
        self._pp_config = PipelineConfig(pp, pp_schedule, pp_microbatches, pp_blocks, pp_split_points,
                                         pp_virtual_stages)
        self._pipeline: Optional[PipelineRunner] = None
        self.parallel_dims: Optional[ParallelDims] = None
        self._flat_meshes: dict[str, DeviceMesh] = {}
        self._grad_buckets: dict[int, GradientBuckets] = {}
        self._armed: Optional[GradientBuckets] = None
        self._train_loaders: list[object] = []
        if not (tp_plan is None or tp_plan in ("auto", "none") or isinstance(tp_plan, Mapping)):
            raise ValueError(f"tp_plan={tp_plan!r}: use 'auto', 'none' or a mapping of module globs to styles, e.g."
                             " {'model.layers.*.mlp.up_proj': 'colwise', 'model.layers.*.mlp.down_proj': 'rowwise'}.")
        if sequence_parallel and pp > 1:
            raise ValueError(f"sequence_parallel=True with pp={pp} is not supported: sequence parallelism keeps the"
                             " hidden state split over the tp ranks as a DTensor, and a pipeline stage sends a plain"
                             " tensor. Use sequence_parallel=False with pipeline parallelism.")
        self._tp_options = dict(tp_plan=tp_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        self.tp_self_check = tp_self_check
        if isinstance(debug_steps, bool) or not isinstance(debug_steps, int) or debug_steps < 1:
            raise ValueError(f"debug_steps={debug_steps!r} must be a positive number of training steps.")
        self.debug, self.debug_steps, self.telemetry = debug, debug_steps, telemetry
        self.broadcast_buffers = bool(broadcast_buffers)  # read by lightning_4d.faults.FaultTolerance
        self._desync: Optional[DesyncMonitor] = None
        self._tp_plan: Optional[TensorParallelPlan] = None
        self._tp_check: Optional[TensorParallelSelfCheck] = None

    # ----------------------------------------------------------------------------------------- layout

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Runs at Trainer construction in the launching process: bad sizes fail before any process starts.
        self.parallel_dims = ParallelDims.resolve(self.num_nodes * self.num_processes, **self._sizes)

    @override
    def setup_environment(self) -> None:
        assert self.parallel_dims is not None
        if self.parallel_dims.pp_enabled and not is_overridden("configure_model", self.lightning_module):
            self._check_pipeline()  # a misfit module fails here, before any process group exists
        self._setup_distributed()
        self._device_mesh, self._flat_meshes = self.parallel_dims.build_mesh(self.root_device.type)
        if self.global_rank == 0:  # the table is O(world) lines: only the rank that prints it builds it
            rank_zero_info(self.layout_table())
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        if self.debug and self._desync is None:
            self._desync = DesyncMonitor(self.parallel_dims, self.group("dp_cp"), self.debug_steps,
                                         timeout=min(self._timeout, timedelta(seconds=60)))
        trainer = self.lightning_module.trainer
        if self.telemetry and not any(isinstance(c, Telemetry) for c in trainer.callbacks):
            trainer.callbacks.append(Telemetry())
        attach_fault_tolerance(self)  # preemption, heartbeats, uneven data, batch shapes, buffers

    def layout_table(self) -> str:
        """Every rank with its (dp, pp, cp, tp) coordinates and the members of its groups."""
        assert self.parallel_dims is not None
        return self.parallel_dims.layout_table()

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one dim (``dp``, ``pp``, ``cp``, ``tp``), of the gradient group ``dp_cp``, or
        under pipelining of the metric group ``pp_dp_cp``."""
        if name in self._flat_meshes:
            return self._flat_meshes[name].get_group()
        return self.device_mesh.get_group(name)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only replicas get different samples; pp, cp and tp peers must see the same batch.
        dp_mesh = self.device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self.lightning_module.trainer.state.stage == RunningStage.TRAINING:
            dataloader = make_resumable(dataloader)
            self._train_loaders.append(dataloader)
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # A checkpoint taken after the epoch's last batch resumes at the start of the next epoch.
        per_epoch = self.lightning_module.trainer.num_training_batches
        consumed = batch_idx + 1 if per_epoch == float("inf") else (batch_idx + 1) % int(per_epoch)
        for loader in self._train_loaders:
            if isinstance(loader, ResumableDataLoader):
                loader.consumed_batches = consumed
        if self._desync is not None:
            self._desync.on_step_start(self.lightning_module, self.lightning_module.trainer.global_step)

    # ------------------------------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._train_loaders.clear()
        self.model = self.precision_plugin.convert_module(self.model)
        self._broadcast_initial_weights()
        tp_plan = self._plan_tensor_parallel()  # on the whole model, before the pipeline cuts it
        self._setup_pipeline()
        self.model_to_device()
        self._setup_tensor_parallel(tp_plan)
        self._setup_context_parallel()
        if self.parallel_dims.tp_enabled or self.parallel_dims.pp_enabled:
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        self._sync_metrics_over_replicas()
        if self.init_from is not None:
            checkpoint.load_weights(self.init_from, self.model, strict=self.lightning_module.strict_loading)
            self.init_from = None  # once: a later validate/test/predict keeps the trained weights
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._build_grad_buckets()
        self.setup_precision_plugin()

    def _broadcast_initial_weights(self) -> None:
        """Every rank starts from rank 0's weights, as with DDP: a module built without a common seed would
        otherwise train a different replica on every rank, and tp/pp would cut shards from different models."""
        module = self.lightning_module
        if module in _broadcast_modules:
            return  # setup runs again for validate/test/predict; the weights are in sync since the first time
        # DTensors come from a parallelization that already placed them (configure_model, an earlier Trainer).
        tensors = [t for t in (*module.parameters(), *module.buffers())
                   if t.device.type != "meta" and not isinstance(t, DTensor)]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1).to(self.root_device) for t in group])
                dist.broadcast(flat, src=0)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        _broadcast_modules.add(module)

    def _check_pipeline(self) -> None:
        """What makes a module unfit for pipelining, found without communicating (the same on every rank)."""
        module = self.lightning_module
        if self._pipeline is not None and self._pipeline.module is module:
            return  # cut by this strategy already (validate/test/predict after fit)
        if not module.automatic_optimization:
            raise ValueError(f"FourDStrategy(pp={self.parallel_dims.pp}) needs automatic optimization, but"
                             f" {type(module).__name__}.automatic_optimization is False: the pipeline schedule runs"
                             " forward and backward of every micro-batch itself, so manual_backward cannot. Use"
                             " automatic optimization, or pp=1.")
        check_splittable(module, self._pp_config)

    def _setup_pipeline(self) -> None:
        """Cut the module down to this rank's stages before the other components see it; once per module,
        since ``setup`` runs again for every validate/test/predict."""
        if not self.parallel_dims.pp_enabled or (
                self._pipeline is not None and self._pipeline.module is self.lightning_module):
            return
        self._check_pipeline()
        self._pipeline = PipelineRunner(self.lightning_module, self._pp_config, self.device_mesh, self.root_device,
                                        self._step_context)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # Lightning's clipping sees this rank's stage and shards only, and torch's refuses plain and DTensor
        # gradients together; the norm must cover the whole model.
        params = list(self.precision_plugin.main_params(optimizer))
        if self._pipeline is not None:
            self._pipeline.clip_grad_norm_(params, float(clip_val))  # a weight tied across stages counts once
        else:
            clip_grad_norm_(params, float(clip_val))

    def _plan_tensor_parallel(self) -> Optional[TensorParallelPlan]:
        """How to shard a module not sharded yet; pure, so a misfit module fails alike on every rank, before any
        collective."""
        module = self.lightning_module
        if not self.parallel_dims.tp_enabled or module in _tensor_parallel_plans:
            return None
        if any(isinstance(p, DTensor) for p in module.parameters()):
            rank_zero_info(f"{type(module).__name__}.configure_model made DTensor parameters: tensor parallelism"
                           " stays as configured there, tp_plan is not applied.")
            return None
        plan = plan_tensor_parallel(module, self.parallel_dims.tp, **self._tp_options)
        if self.global_rank == 0:
            rank_zero_info(plan.describe())
        return plan

    def _setup_tensor_parallel(self, plan: Optional[TensorParallelPlan]) -> None:
        """Shard in place, once per module (``setup`` runs again for every validate/test/predict), then enter
        the module's plan around every step and backward."""
        module = self.lightning_module
        if plan is not None:
            self._tp_check = apply_tensor_parallel(module, self.device_mesh["tp"], plan,
                                                   self_check=self.tp_self_check)
            _tensor_parallel_plans[module] = plan
        applied = _tensor_parallel_plans.get(module)
        self._tp_plan = applied if applied is not None and applied.enabled else None

    def _sync_metrics_over_replicas(self) -> None:
        """torchmetrics sync over the world by default; ranks of one replica hold the same state, except cp
        ranks, whose metrics each saw their part of every sequence. Under pipelining only the last stage
        updates metrics and the others keep default states (zeros, empty lists), so the sync also spans the
        pipeline ranks and gives every rank the last stage's values."""
        from torchmetrics import Metric

        group = self.group("pp_dp_cp" if self.parallel_dims.pp_enabled else "dp_cp")
        for metric in self.lightning_module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = group

    def _setup_context_parallel(self) -> None:
        """Hooks for sharded sequences; ``setup`` runs again for every fit/validate/test, so old ones go first."""
        self._remove_context_parallel()
        if self.parallel_dims.cp_enabled:
            # Sequence parallelism splits each cp shard again over the tp ranks.
            sp = self.parallel_dims.tp if self._tp_plan is not None and self._tp_plan.sequence_parallel else 1
            self._context_parallel = ContextParallel(self.lightning_module, self.group("cp"), **self._cp_options,
                                                     sequence_parallel=sp)

    def _remove_context_parallel(self) -> None:
        if self._context_parallel is not None:
            self._context_parallel.remove()
            self._context_parallel = None

    def _build_grad_buckets(self) -> None:
        self._remove_grad_buckets()
        group = self.group("dp_cp")
        for optimizer in self.optimizers:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._grad_buckets[id(optimizer)] = GradientBuckets(params, group, self.bucket_mb)

    def _remove_grad_buckets(self) -> None:
        for buckets in self._grad_buckets.values():
            buckets.remove()
        self._grad_buckets.clear()

    # ------------------------------------------------------------------------------- step methods

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        trainer = self.lightning_module.trainer
        if self._desync is not None and trainer.training:
            self._desync.check_batch(batch, trainer.global_step)
        # Prediction outputs are per token or per sequence, so prediction runs on whole sequences.
        if self._context_parallel is not None and not self.lightning_module.trainer.predicting:
            batch = self._context_parallel.shard_batch(batch)
        return batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            # The schedule runs the backward passes here too.
            with self.precision_plugin.train_step_context(), self._tensor_parallel_check(), \
                    self._tensor_parallel_context():
                output = self._pipeline.step("training_step", args, kwargs)
        else:
            with self._tensor_parallel_check(), self._step_context():
                output = super().training_step(*args, **kwargs)
        if self._context_parallel is not None:
            output = self._context_parallel.global_loss(output)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _evaluation_step(self, name: str, precision_context: Callable[[], AbstractContextManager[None]],
                         args: tuple, kwargs: dict) -> Any:
        if self._pipeline is not None:
            with precision_context():
                return self._pipeline.step(name, args, kwargs)
        with self._step_context():
            return getattr(super(), name)(*args, **kwargs)

    @contextmanager
    def _tensor_parallel_check(self) -> Iterator[None]:
        """Around the first training step after sharding: each sharded block type against an unsharded copy."""
        check, self._tp_check = self._tp_check, None
        if check is None:
            yield
            return
        check.arm()
        try:
            yield
        except Exception:
            check.verify(failed=True)  # names a sharded block that could not run; otherwise the error stands
            raise
        check.verify()

    def _tensor_parallel_context(self) -> AbstractContextManager[None]:
        return self._tp_plan.step_context() if self._tp_plan is not None else nullcontext()

    @contextmanager
    def _step_context(self) -> Iterator[None]:
        """What every call of a user step method runs inside: each model-parallel component's context
        (tensor parallelism's loss-parallel cross entropy, then context-parallel attention)."""
        with ExitStack() as stack:
            for component in (self._tp_plan, self._context_parallel):
                if component is not None:
                    stack.enter_context(component.step_context())
            yield

    # --------------------------------------------------------------------------- optimizer steps

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        buckets = self._grad_buckets.get(id(optimizer))
        if buckets is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_with_gradient_sync() -> Any:
            # Lightning's accumulation micro-steps call the closure directly, never through here,
            # so only the backward right before the optimizer step communicates.
            # Under pipelining the schedule runs a backward per micro-batch: the buckets wait for ``backward``
            # to commit the gradients, then ``synchronize`` reduces them all.
            buckets.begin(overlap=self._pipeline is None)
            self._armed = buckets
            try:
                result = closure()
            finally:
                self._armed = None
            buckets.synchronize()
            return result

        return super().optimizer_step(optimizer, closure_with_gradient_sync, model, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        lightning_module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lightning_module)
        if self._pipeline is not None:
            self._pipeline.commit_gradients()  # the schedule ran the backward passes inside training_step
        else:
            with self._tensor_parallel_context():
                self.precision_plugin.backward(closure_loss, lightning_module, optimizer, *args, **kwargs)
        if self._armed is not None:
            # As with DDP, ``on_after_backward`` sees averaged gradients.
            self._armed.synchronize()
        closure_loss = self.precision_plugin.post_backward(closure_loss, lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # --------------------------------------------------------------------------------- collectives

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce over the data-parallel replicas: other ranks of a replica hold the same value already."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group or self._replica_group(), reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather one value per data-parallel replica, as DDP would with that many processes."""
        return _all_gather_ddp_if_available(tensor, group=group or self._replica_group(), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)

    def _replica_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("dp") if self._device_mesh is not None else None

    # --------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpoint.model_state(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return checkpoint.optimizer_state(self.model, getattr(optimizer, "_optimizer", optimizer))

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("FourDStrategy.save_checkpoint(storage_options=...) is not supported: it writes with"
                            " torch.distributed.checkpoint, not a CheckpointIO.")
        checkpoint.save(checkpoint_dict, self.broadcast(str(filepath)), is_writer=self.global_rank == 0)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return checkpoint.load(self.broadcast(str(checkpoint_path)), self.model, self.optimizers,
                               strict=self.lightning_module.strict_loading)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            checkpoint.remove(filepath)

    # ------------------------------------------------------------------------------------ teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_failure(self.global_rank, exception, self.world_size)

    @override
    def teardown(self) -> None:
        if self._desync is not None:
            self._desync.stop_tracing()
        self._remove_grad_buckets()
        self._remove_context_parallel()
        super().teardown()


def _raise_unknown_arguments(unknown: dict[str, Any]) -> None:
    known = [name for name in inspect.signature(FourDStrategy.__init__).parameters if name not in ("self", "unknown")]
    lines = []
    for name, value in unknown.items():
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known arguments: {', '.join(known)}."
        lines.append(f"unknown argument {name}={value!r}: {hint}")
    raise ValueError("FourDStrategy got " + "; ".join(lines))


StrategyRegistry.register(
    FourDStrategy.strategy_name, FourDStrategy, description="4D parallelism (dp, pp, cp, tp) from lightning-4d"
)
