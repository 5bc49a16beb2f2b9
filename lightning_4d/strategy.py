"""``FourDStrategy``: Lightning's hooks mapped onto one composition. It validates the layout before any process
starts, builds the mesh, hands the module to :func:`~lightning_4d.composition.parallelize.parallelize` and forwards
each hook to the ``ParallelModel`` it got back; Lightning's ``reduce`` and ``all_gather`` go to the replicas."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partialmethod
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d import _compat as compat, checkpoint
from lightning_4d.arguments import positive, refuse_unknown
from lightning_4d.callbacks import attach_prediction_writers, check_weight_averaging
from lightning_4d.checkpoint.resumable_loader import TrainLoaders, continue_as_uninterrupted
from lightning_4d.checkpoint.writer import CheckpointWriter, honored_checkpoint_io
from lightning_4d.composition.auto_layout import adopt, check_auto_layout, choose_for
from lightning_4d.composition.parallel_model import ParallelModel
from lightning_4d.composition.parallelize import check_before_launch, parallelize, parallelized
from lightning_4d.context_parallel import ContextParallelConfig
from lightning_4d.context_parallel.config import DEFAULT_CHECK_TOKENS
from lightning_4d.data_parallel import (DEFAULT_BUCKET_MB, check_reshard_after_forward, check_shard_units,
                                        param_dtype_for)
from lightning_4d.data_parallel.batchnorm import batchnorm_statistics, restore_batchnorm
from lightning_4d.faults import attach as attach_fault_tolerance, report_failure
from lightning_4d.faults.preemption import Preempted
from lightning_4d.faults.report import destroy_process_groups_at_exit
from lightning_4d.faults.timeouts import DEFAULT_INIT_TIMEOUT, DEFAULT_TIMEOUT, CollectiveTimeouts
from lightning_4d.launcher import ForkLauncher, attempt_store, check_start_method
from lightning_4d.memory.activation_checkpointing import ActivationCheckpointConfig
from lightning_4d.memory.compile import CompileConfig
from lightning_4d.numerics.clipping import install_clipping
from lightning_4d.numerics.token_losses import check_normalization
from lightning_4d.observability import DesyncMonitor, attach as attach_observability
from lightning_4d.parallel_dims import ParallelDims, ParallelMesh, Size, check_ep_size
from lightning_4d.pipeline import PipelineConfig
from lightning_4d.tensor_parallel import TensorParallelConfig


class FourDStrategy(ModelParallelStrategy):
    """Data, tensor/sequence, context and pipeline parallelism for an unchanged LightningModule.

    Args:
        dp, pp, cp, tp, ep: data-parallel replicas (``"auto"``: what the others leave of the world), pipeline stages,
            context-parallel ranks splitting each sequence, tensor-parallel ranks splitting each layer, and expert
            parallelism (experts split over ``ep`` ranks of ``dp x cp``; :mod:`lightning_4d.expert_parallel`).
        dp_shard, reshard_after_forward, reduce_scatter_every_batch, shard_units: FSDP2 over ``dp_shard`` ranks per
            replica (HSDP with ``dp > 1``); whether a block frees its gathered weights after forward (``"auto"``: all
            but the last); whether every accumulation batch reduce-scatters; units per ``"blocks"`` or ``"modules"``
            (one per weight matrix: least memory); see :mod:`lightning_4d.data_parallel.fsdp`.
        bucket_mb: size of a gradient all-reduce bucket in megabytes.
        timeout, init_timeout: how long a collective may wait, once training runs (2 minutes) and while the run
            starts or saves (10 minutes), before the waiting ranks fail naming what each rank was last doing.
        process_group_backend: ``"nccl"``/``"gloo"``; by default chosen from the device.
        init_from, init_from_prefix: weights to start from (a Hugging Face, DCP or lightning-4d directory, a
            Lightning checkpoint or a ``state_dict`` file), each rank reading what it holds; the module path of the
            file's keys (``None``: found); see :mod:`lightning_4d.checkpoint.pretrained`.
        cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers, cp_document_key, cp_check,
            cp_check_tokens: see :class:`~lightning_4d.context_parallel.config.ContextParallelConfig` (``cp_check``:
            the first batches' steps run sharded and whole, a difference refused before any weight changes).
        pp_schedule, pp_microbatches, pp_blocks, pp_split_points, pp_virtual_stages: see
            :class:`~lightning_4d.pipeline.PipelineConfig` (schedules ``gpipe``, ``1f1b``, ``interleaved_1f1b``,
            ``looped_bfs``, ``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipev``).
        tp_plan, sequence_parallel, tp_self_check, tp_strict, loss_parallel: the plan (``"auto"``, ``"none"``, or
            FQN globs to styles merged over the automatic one; a ``configure_model`` that made DTensors is kept),
            activations sharded on the sequence between regions, the first batch's check of one sharded block per
            type against a whole copy, raising when under 90% of the body is sharded, and cross entropy on
            vocabulary-sharded logits; see :class:`~lightning_4d.tensor_parallel.TensorParallelConfig`.
        loss_normalization: ``"tokens"`` weighs every valid target of the accumulation window once, wherever it is
            held, as one process does; ``"batch"`` per batch (Lightning's accumulation); ``"replica"`` each rank's
            own mean (DDPStrategy's); see :mod:`lightning_4d.numerics.token_losses`.
        fuse_lm_loss: compute the LM head's cross entropy from the head's input in chunks of tokens, so that its
            logits never exist whole; any other use of the logits gets them whole; see
            :mod:`lightning_4d.numerics.head_loss`.
        activation_checkpointing, activation_checkpointing_every, compile: ``"none"``/``"full"``/``"every_n"``/
            ``"selective"`` and its ``n``; ``torch.compile`` per block (``True`` or its options); see
            :mod:`lightning_4d.memory`.
        debug, debug_steps: for the first steps, check that a replica's ranks get identical batches, keep
            replicated weights bit-identical and issue the same collectives.
        telemetry: add the :class:`~lightning_4d.observability.telemetry.Telemetry` callback.
        broadcast_buffers: broadcast buffers within each replica before every training step, as DDP does.
        async_save: checkpoint saves block the step only while each rank copies its shard into host memory; the
            writing goes on in the background (also with ``Trainer(plugins=[AsyncCheckpointIO()])``); see
            :mod:`lightning_4d.checkpoint.writer`.
        start_method: ``"popen"`` runs the script again per rank (as DDP does); ``"fork"`` (CPU) forks them.
        layout: ``"auto"``: the sizes not given, activation checkpointing and the pipeline's micro-batches are chosen
            at set-up by predicted time per sample (:mod:`lightning_4d.composition.auto_layout`).
        memory_per_device: the budget ``layout="auto"`` chooses within (bytes, or ``"80GiB"``); default: the
            device's free memory (GPU), the machine's memory shared by its ranks (CPU).
    """

    strategy_name = "fourd"

    def __init__(
        self, dp: Size = "auto", pp: int = 1, cp: int = 1, tp: int = 1, dp_shard: Size = 1, ep: int = 1,
        reshard_after_forward: Union[bool, Literal["auto"]] = "auto", reduce_scatter_every_batch: bool = False,
        shard_units: Literal["blocks", "modules"] = "blocks", bucket_mb: float = DEFAULT_BUCKET_MB,
        timeout: timedelta = DEFAULT_TIMEOUT, init_timeout: timedelta = DEFAULT_INIT_TIMEOUT,
        process_group_backend: Optional[str] = None, init_from: Optional[str] = None,
        init_from_prefix: Optional[str] = None, cp_comm: Literal["ring", "allgather", "a2a"] = "ring",
        cp_seq_dim: int = 1, cp_batch_keys: Optional[list[Union[str, int]]] = None,
        cp_position_modules: Optional[list[str]] = None, cp_buffers: Optional[list[str]] = None,
        cp_document_key: Optional[str] = None,
        cp_check: bool = True, cp_check_tokens: int = DEFAULT_CHECK_TOKENS, pp_schedule: str = "1f1b",
        pp_microbatches: Optional[int] = None, pp_blocks: Optional[str] = None,
        pp_split_points: Optional[list[int]] = None, pp_virtual_stages: Optional[int] = None,
        tp_plan: Union[str, dict, None] = "auto", sequence_parallel: bool = False, tp_self_check: bool = True,
        tp_strict: bool = False, loss_parallel: bool = True,
        loss_normalization: Literal["tokens", "batch", "replica"] = "tokens", fuse_lm_loss: bool = True,
        activation_checkpointing: str = "none", activation_checkpointing_every: int = 2,
        compile: Union[bool, dict] = False, debug: bool = False, debug_steps: int = 2, telemetry: bool = False,
        broadcast_buffers: bool = True, start_method: Literal["popen", "fork"] = "popen", async_save: bool = False,
        layout: Optional[Literal["auto"]] = None, memory_per_device: Union[str, float, None] = None, **unknown: Any,
    ) -> None:
        refuse_unknown(FourDStrategy.__init__, unknown)
        self.collective_timeouts = CollectiveTimeouts(init_timeout, timeout)  # read by FaultTolerance
        super().__init__(process_group_backend=process_group_backend, timeout=self.collective_timeouts.init)
        self.timeout = self.collective_timeouts.train
        positive("bucket_mb", bucket_mb, "megabytes (default 25)")
        self.requested_sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "dp_shard": dp_shard, "ep": ep}
        ParallelDims.check_sizes(dp, pp, cp, tp, dp_shard), check_ep_size(ep)
        check_reshard_after_forward(reshard_after_forward), check_normalization(loss_normalization)
        if not isinstance(fuse_lm_loss, bool):
            raise ValueError(f"fuse_lm_loss={fuse_lm_loss!r}: use True (the LM head's cross entropy computed in chunks,"
                             " its logits never whole) or False (the head's logits computed whole, as the module"
                             " computes them).")
        self.init_from, self.init_from_prefix = init_from, init_from_prefix
        # Typed per-dimension options, each validated on construction (before any process starts).
        self.cp_config = ContextParallelConfig(cp, cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers,
                                               cp_document_key, cp_check, cp_check_tokens)
        self.pp_config = PipelineConfig(pp, pp_schedule, pp_microbatches, pp_blocks, pp_split_points, pp_virtual_stages)
        self.tp_config = TensorParallelConfig(tp, tp_plan, sequence_parallel, loss_parallel, tp_self_check, tp_strict)
        self.tp_config.check_with_pipeline(self.pp_config.pp)
        compile_config = CompileConfig.build(compile)
        check_shard_units(shard_units, self.pp_config.pp, self.tp_config.tp, compile_config.enabled)
        # The composition's options, as parallelize() takes them.
        checkpointing = ActivationCheckpointConfig(activation_checkpointing, activation_checkpointing_every)
        self.composition = dict(pipeline=self.pp_config, tensor=self.tp_config, context=self.cp_config,
                           activation_checkpointing=checkpointing,
                           compile=compile_config, bucket_mb=float(bucket_mb), shard_units=shard_units,
                           reshard_after_forward=reshard_after_forward, loss_normalization=loss_normalization,
                           fuse_lm_loss=fuse_lm_loss,
                           reduce_scatter_every_batch=bool(reduce_scatter_every_batch))
        self.parallel_dims: Optional[ParallelDims] = None
        self.mesh: Optional[ParallelMesh] = None  # every process group by name: ``mesh.group("dp")``
        self.parallel: Optional[ParallelModel] = None  # the module made parallel, set in ``setup``
        self._train_loaders = TrainLoaders()
        self._gradients_zeroed = False  # set per training batch (on_train_batch_start)
        positive("debug_steps", debug_steps, "training steps", integer=True)
        self.debug, self.debug_steps, self.telemetry = debug, debug_steps, telemetry
        self.broadcast_buffers = bool(broadcast_buffers)  # read by lightning_4d.faults.FaultTolerance
        check_start_method(start_method)
        self.start_method, self._fork_launcher = start_method, None
        self._desync: Optional[DesyncMonitor] = None
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save={async_save!r}: use True (saves write in the background) or False.")
        self.async_save, self.checkpoints = async_save, None  # the CheckpointWriter, made in setup_environment
        self.auto_layout, self.memory_per_device = check_auto_layout(layout, memory_per_device)

    @property
    @override
    def launcher(self) -> Any:
        if self.start_method == "fork" and super().launcher is not None:  # None: ranks were started outside
            self._fork_launcher = self._fork_launcher or ForkLauncher(self)
            return self._fork_launcher
        return super().launcher

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Runs at Trainer construction in the launching process: bad sizes fail before any process starts.
        self.parallel_dims = ParallelDims.resolve(self.num_nodes * self.num_processes, **self.requested_sizes)
        self.async_save = honored_checkpoint_io(self.checkpoint_io) or self.async_save

    @override
    def setup_environment(self) -> None:
        module, dims = self.lightning_module, self.parallel_dims
        own_layout = is_overridden("configure_model", module)
        if not self.auto_layout:  # with layout="auto", once chosen (setup)
            check_before_launch(module, dims, pipeline=self.pp_config, tensor=self.tp_config,
                                user_parallelized=own_layout)
            check_weight_averaging(module.trainer.callbacks, dims)
        compat.setup_distributed(self, attempt_store)  # under torchrun: a store per attempt
        destroy_process_groups_at_exit()
        if not self.auto_layout:
            self._lay_out(own_layout)
        attach_prediction_writers((trainer := module.trainer).callbacks)  # one writing rank per replica
        attach_fault_tolerance(self)  # preemption, heartbeats, uneven data, batch shapes, buffers
        self.checkpoints = self.checkpoints or CheckpointWriter.for_strategy(self)
        self.checkpoints.route_links(trainer.callbacks, self.barrier)  # ModelCheckpoint's save_last="link"

    def _lay_out(self, own_layout: bool) -> None:
        """The mesh of the layout, given to Lightning and the module, and what needs it (debug, telemetry)."""
        module = self.lightning_module
        self.mesh = self.parallel_dims.build(self.root_device.type, lightning_names=own_layout)
        compat.set_device_mesh(self, self.mesh.mesh)
        if self.global_rank == 0:  # the table is O(world) lines: only the rank that prints it builds it
            rank_zero_info(self.layout_table())
        compat.set_device_mesh(module, self.mesh.mesh)
        self._desync = attach_observability(self, module.trainer.callbacks, self._desync)

    def _choose_layout(self, trainer: pl.Trainer) -> None:
        """``layout="auto"``: the sizes, checkpointing and micro-batches chosen now that the module and its data
        are set up (:mod:`lightning_4d.composition.auto_layout`)."""
        choice = choose_for(self, trainer)
        adopt(self, choice)  # its sizes, configs and composition options
        if self.global_rank == 0:
            rank_zero_info(choice.describe())
        check_before_launch(self.lightning_module, self.parallel_dims, pipeline=self.pp_config, tensor=self.tp_config,
                            user_parallelized=False)
        check_weight_averaging(trainer.callbacks, self.parallel_dims)
        self._lay_out(own_layout=False)

    def layout_table(self) -> str:
        """Every rank with its (dp, pp, cp, tp) coordinates and the members of its groups."""
        return self.parallel_dims.layout_table()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only replicas get different samples; pp, cp and tp peers must see the same batch.
        dp_mesh = self.mesh.submesh("dp")  # every data-parallel rank: replicas and shards
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        training = self.lightning_module.trainer.state.stage == RunningStage.TRAINING
        return self._train_loaders.track(dataloader) if training else dataloader

    @override
    def on_train_start(self) -> None:  # a resume at an epoch's end continues as the uninterrupted run
        super().on_train_start()
        continue_as_uninterrupted(self.lightning_module.trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        module = self.lightning_module
        self._train_loaders.consumed(batch_idx + 1, module.trainer.num_training_batches)
        self.checkpoints.raise_if_failed()
        # Lightning's own rule: automatic optimization zeroes the gradients right after the first training_step
        # of each accumulation window (unless the module replaces optimizer_zero_grad).
        self._gradients_zeroed = (module.automatic_optimization and not is_overridden("optimizer_zero_grad", module)
                                  and batch_idx % module.trainer.accumulate_grad_batches == 0)
        if self._desync is not None:
            self._desync.on_step_start(self.lightning_module, self.lightning_module.trainer.global_step)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.mesh is None and self.auto_layout:
            self._choose_layout(trainer)
        assert self.model is not None and self.accelerator is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        self._train_loaders.clear()
        self.model = self.precision_plugin.convert_module(self.model)
        first = parallelized(self.lightning_module) is None
        # With init_from (strict), the load right below fills every weight: parallelize neither broadcasts rank
        # 0's nor initializes a meta-built module's (only what no checkpoint holds: non-persistent buffers).
        loading = self.init_from is not None and self.lightning_module.strict_loading
        self.parallel = parallelize(self.lightning_module, self.mesh, self.root_device, **self.composition, loading=loading,
                                    param_dtype=param_dtype_for(str(getattr(self.precision_plugin, "precision", ""))))
        if first and self.global_rank == 0 and self.parallel.describe():
            rank_zero_info(self.parallel.describe())
        dims = self.parallel_dims
        install_clipping(self.precision_plugin, self.parallel, whole_model=dims.tp_enabled or dims.pp_enabled
                         or dims.dp_shard_enabled or dims.ep_enabled)
        batchnorm_statistics(self.lightning_module, {"dp": dims.dp * dims.dp_shard, "cp": dims.cp},
                             self.mesh.group("dp_cp"), compat.sync_batchnorm_requested(self), warn=first)
        if self.init_from is not None:
            self.parallel.load_weights(self.init_from, strict=self.lightning_module.strict_loading,
                                       prefix=self.init_from_prefix)
            self.init_from = None  # once: a later validate/test/predict keeps the trained weights
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.parallel.attach_optimizers(self.optimizers)
        self.setup_precision_plugin()

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """``manual_backward`` inside accumulates this rank's gradients unsynchronized (DDP's ``no_sync``); the next
        one outside synchronizes all of them, and clipping or stepping before it raises."""
        with self.parallel.block_sync() if self.parallel is not None else nullcontext():
            yield

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # The batch in host memory too, for the decisions context parallelism takes on the host (which attention
        # tiles a mask hides), unless the module's transfer hooks may change it on the way to the device.
        module = self.lightning_module
        host = None if any(is_overridden(hook, module) for hook in ("transfer_batch_to_device",
                                                                    "on_after_batch_transfer")) else batch
        batch = super().batch_to_device(batch, device, dataloader_idx)
        trainer = module.trainer
        if self._desync is not None and trainer.training:
            self._desync.check_batch(batch, trainer.global_step)
        # Prediction outputs are per token or per sequence, so prediction runs on whole sequences.
        if trainer.predicting:
            return batch
        step = "training_step" if trainer.training else "test_step" if trainer.testing else "validation_step"
        return self.parallel.shard_batch(batch, step, host=host)

    def _step(self, name: str, precision_context: str, *args: Any, **kwargs: Any) -> Any:
        """The module's step method ``name``, run by the ParallelModel inside the precision plugin's context."""
        trainer = self.lightning_module.trainer
        with getattr(self.precision_plugin, precision_context)():
            return self.parallel.step(name, args, kwargs, predicting=trainer.predicting,
                                      accumulate_grad_batches=trainer.accumulate_grad_batches,
                                      gradients_zeroed=name == "training_step" and self._gradients_zeroed)

    training_step = partialmethod(_step, "training_step", "train_step_context")
    validation_step = partialmethod(_step, "validation_step", "val_step_context")
    test_step = partialmethod(_step, "test_step", "test_step_context")
    predict_step = partialmethod(_step, "predict_step", "predict_step_context")

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None, **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, self.parallel.synchronizing(optimizer, closure), model, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.parallel.backward(lambda: self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs))
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Over the replicas (a replica's ranks hold one value); over one replica nothing to do, not even a barrier."""
        group = group or self._replicas()
        tensor = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor  # a loss_parallel() loss
        if isinstance(tensor, Tensor) and (group is None or dist.get_world_size(group) > 1):
            return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather one value per data-parallel replica, as DDP would with that many processes."""
        return compat.all_gather_ddp_if_available(tensor, group=group or self._replicas(), sync_grads=sync_grads)

    def _replicas(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("dp") if self.mesh is not None else None

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.parallel.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.parallel.optimizer_state(getattr(optimizer, "optimizer", optimizer))  # LightningOptimizer's

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:  # written with torch.distributed.checkpoint, not a CheckpointIO
            raise TypeError("FourDStrategy.save_checkpoint(storage_options=...): not supported, it writes DCP shards.")
        with self.collective_timeouts.long():
            self.checkpoints.save(checkpoint_dict, self.broadcast(str(filepath)))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with self.collective_timeouts.long():
            return self.parallel.load(self.broadcast(str(checkpoint_path)), self.optimizers,
                                      strict=self.lightning_module.strict_loading)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath)  # once the save in flight is in place

    @override
    def on_exception(self, exception: BaseException) -> None:  # the first failure, named on every rank
        if self.checkpoints is not None and not isinstance(exception, Preempted):
            self.checkpoints.abandon()  # a save in flight may wait on a rank that is gone
        report_failure(self.global_rank, exception, self.world_size)

    @override
    def teardown(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.finish()
        if self._desync is not None:
            self._desync.stop_tracing()
        if self.parallel is not None:
            self.parallel.remove()
        if self.lightning_module is not None:
            restore_batchnorm(self.lightning_module)
        super().teardown()


compat.refuse_directories_in_load_from_checkpoint(checkpoint.directory_message)
StrategyRegistry.register(
    FourDStrategy.strategy_name, FourDStrategy, description="4D parallelism (dp, pp, cp, tp) from lightning-4d"
)
