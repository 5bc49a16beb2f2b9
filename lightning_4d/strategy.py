"""``FourDStrategy``: Lightning's hooks mapped onto one composition. It validates the layout before any process
starts, builds the mesh, hands the module to :func:`~lightning_4d.composition.parallelize.parallelize` and forwards
each hook to the ``ParallelModel`` it got back; Lightning's ``reduce`` and ``all_gather`` go to the replicas."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from functools import partialmethod
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d import _compat as compat, checkpoint
from lightning_4d.arguments import positive, refuse_unknown
from lightning_4d.callbacks import attach_prediction_writers
from lightning_4d.checkpoint.resumable_loader import TrainLoaders, continue_as_uninterrupted
from lightning_4d.checkpoint.writer import CheckpointWriter, check_async_save, honored_checkpoint_io
from lightning_4d.composition.auto_layout import adopt, check_auto_layout, choose_for
from lightning_4d.composition.options import check_layout, composition_options
from lightning_4d.composition.parallel_model import ParallelModel
from lightning_4d.composition.parallelize import parallelize_for_trainer
from lightning_4d.context_parallel.config import DEFAULT_CHECK_TOKENS
from lightning_4d.data_parallel import DEFAULT_BUCKET_MB
from lightning_4d.data_parallel.batchnorm import restore_batchnorm
from lightning_4d.faults import Preempted, attach as attach_fault_tolerance, report_failure
from lightning_4d.faults.report import destroy_process_groups_at_exit
from lightning_4d.faults.timeouts import DEFAULT_INIT_TIMEOUT, DEFAULT_TIMEOUT, CollectiveTimeouts
from lightning_4d.launcher import ForkLauncher, attempt_store, check_start_method
from lightning_4d.observability import DesyncMonitor, attach as attach_observability
from lightning_4d.parallel_dims import ParallelDims, ParallelMesh, Size, begin_run_keys


class FourDStrategy(ModelParallelStrategy):
    """Data, tensor/sequence, context and pipeline parallelism for an unchanged LightningModule.

    Args:
        dp, pp, cp, tp, ep: data-parallel replicas (``"auto"``: what the others leave of the world), pipeline stages,
            ranks splitting each sequence (context), ranks splitting each layer (tensor), and ranks of ``dp x cp``
            splitting the experts (:mod:`lightning_4d.expert_parallel`).
        dp_shard, reshard_after_forward, reduce_scatter_every_batch, shard_units: FSDP2 over ``dp_shard`` ranks per
            replica (HSDP with ``dp > 1``); whether a block frees its gathered weights after forward (``"auto"``: all
            but the last); whether every accumulation batch reduce-scatters; units per ``"blocks"`` or ``"modules"``
            (one per weight matrix: least memory); see :mod:`lightning_4d.data_parallel.fsdp`.
        bucket_mb: size of a gradient all-reduce bucket in megabytes.
        timeout, init_timeout: how long a collective may wait while training runs (2 minutes) and while the run
            starts or saves (10 minutes), before the waiting ranks fail naming what each rank was last doing.
        process_group_backend: ``"nccl"``/``"gloo"``; by default chosen from the device.
        init_from, init_from_prefix: weights to start from (a Hugging Face, DCP or lightning-4d directory, a
            Lightning checkpoint or ``state_dict`` file), each rank reading what it holds, and the module path of
            the file's keys (``None``: found); see :mod:`lightning_4d.checkpoint.pretrained`.
        cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers, cp_document_key, cp_check,
            cp_check_tokens: see :class:`~lightning_4d.context_parallel.config.ContextParallelConfig`.
        pp_schedule, pp_microbatches, pp_blocks, pp_split_points, pp_virtual_stages: the schedule, micro-batches,
            block list, stage cuts and stages per rank; see :class:`~lightning_4d.pipeline.PipelineConfig`.
        tp_plan, sequence_parallel, tp_self_check, tp_strict, loss_parallel: the plan (``"auto"``, ``"none"`` or FQN
            globs to styles), sequence-sharded activations, a first-batch check against a whole copy, raising if
            under-sharded, sharded cross entropy; see :class:`~lightning_4d.tensor_parallel.TensorParallelConfig`.
        loss_normalization: ``"tokens"``: each valid target of the accumulation window weighs once, as in one process;
            ``"batch"``: per batch (Lightning's); ``"replica"``: per rank (DDP's); see ``numerics.token_losses``.
        fuse_lm_loss: the LM head's cross entropy in chunks, logits whole only if used; see ``numerics.head_loss``.
        activation_checkpointing, activation_checkpointing_every, compile: ``"none"``, ``"full"``, ``"every_n"`` or
            ``"selective"`` and its ``n``; ``torch.compile`` per block (``True``/options); :mod:`lightning_4d.memory`.
        debug, debug_steps: for the first steps, check that a replica's ranks agree on batches, weights and collectives.
        telemetry: add the :class:`~lightning_4d.observability.telemetry.Telemetry` callback.
        broadcast_buffers: broadcast buffers within each replica before every training step, as DDP does.
        async_save: a save blocks the step only while each rank copies its shard to host memory, then writes in the
            background (also set by ``Trainer(plugins=[AsyncCheckpointIO()])``; :mod:`lightning_4d.checkpoint.writer`).
        start_method: ``"popen"`` runs the script again per rank (as DDP does); ``"fork"`` (CPU) forks them.
        layout, memory_per_device, layout_trials: ``"auto"``: sizes not given, checkpointing and micro-batches chosen
            at set-up by predicted time per sample, within a budget per device (bytes, ``"80GiB"``; default: free GPU
            memory, or the machine's per rank); ``layout_trials=k``: the k predicted fastest run steps, fastest wins.
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
        cp_document_key: Optional[str] = None, cp_check: bool = True, cp_check_tokens: int = DEFAULT_CHECK_TOKENS,
        pp_schedule: str = "1f1b", pp_microbatches: Optional[int] = None, pp_blocks: Optional[str] = None,
        pp_split_points: Optional[list[int]] = None, pp_virtual_stages: Optional[int] = None,
        tp_plan: Union[str, dict, None] = "auto", sequence_parallel: bool = False, tp_self_check: bool = True,
        tp_strict: bool = False, loss_parallel: bool = True,
        loss_normalization: Literal["tokens", "batch", "replica"] = "tokens", fuse_lm_loss: bool = True,
        activation_checkpointing: str = "none", activation_checkpointing_every: int = 2,
        compile: Union[bool, dict] = False, debug: bool = False, debug_steps: int = 2, telemetry: bool = False,
        broadcast_buffers: bool = True, start_method: Literal["popen", "fork"] = "popen", async_save: bool = False,
        layout: Optional[Literal["auto"]] = None, memory_per_device: Union[str, float, None] = None,
        layout_trials: int = 1, **unknown: Any,
    ) -> None:
        refuse_unknown(FourDStrategy.__init__, unknown)
        self.collective_timeouts = CollectiveTimeouts(init_timeout, timeout)  # read by FaultTolerance
        super().__init__(process_group_backend=process_group_backend, timeout=self.collective_timeouts.init)
        self.timeout = self.collective_timeouts.train
        self.requested_sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "dp_shard": dp_shard, "ep": ep}
        self.composition = composition_options(  # validated now, before any process starts
            self.requested_sizes, bucket_mb=bucket_mb, reshard_after_forward=reshard_after_forward,
            reduce_scatter_every_batch=reduce_scatter_every_batch, shard_units=shard_units,
            loss_normalization=loss_normalization, fuse_lm_loss=fuse_lm_loss, cp_comm=cp_comm, cp_seq_dim=cp_seq_dim,
            cp_batch_keys=cp_batch_keys, cp_position_modules=cp_position_modules, cp_buffers=cp_buffers,
            cp_document_key=cp_document_key, cp_check=cp_check, cp_check_tokens=cp_check_tokens,
            pp_schedule=pp_schedule, pp_microbatches=pp_microbatches, pp_blocks=pp_blocks,
            pp_split_points=pp_split_points, pp_virtual_stages=pp_virtual_stages, tp_plan=tp_plan,
            sequence_parallel=sequence_parallel, tp_self_check=tp_self_check, tp_strict=tp_strict,
            loss_parallel=loss_parallel, activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every, compile=compile)
        self.cp_config, self.pp_config, self.tp_config = map(self.composition.get, ("context", "pipeline", "tensor"))
        self.init_from, self.init_from_prefix = init_from, init_from_prefix
        self.parallel_dims: Optional[ParallelDims] = None
        self.mesh: Optional[ParallelMesh] = None  # every process group by name: ``mesh.group("dp")``
        self.parallel: Optional[ParallelModel] = None  # the module made parallel, set in ``setup``
        self._train_loaders = TrainLoaders()
        self._gradients_zeroed = False  # set per training batch (on_train_batch_start)
        positive("debug_steps", debug_steps, "training steps", integer=True)
        self.debug, self.debug_steps, self.telemetry = debug, debug_steps, telemetry
        self.broadcast_buffers = bool(broadcast_buffers)  # read by lightning_4d.faults.FaultTolerance
        self.start_method, self._fork_launcher = check_start_method(start_method), None
        self._desync: Optional[DesyncMonitor] = None
        self.async_save, self.checkpoints = check_async_save(async_save), None  # the CheckpointWriter, made at set-up
        self.auto_layout, self.memory_per_device, self.layout_trials = check_auto_layout(layout, memory_per_device,
                                                                                         layout_trials)

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
        module = self.lightning_module
        own_layout = is_overridden("configure_model", module)
        if not self.auto_layout:  # with layout="auto", once chosen (setup)
            check_layout(self, user_parallelized=own_layout)
        compat.setup_distributed(self, attempt_store)  # under torchrun: a store per attempt
        begin_run_keys()  # this run's keys in the store, before the first barrier and the callbacks' heartbeats
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

    def layout_table(self) -> str:
        """Every rank with its (dp, pp, cp, tp) coordinates and the members of its groups."""
        return self.parallel_dims.layout_table()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.mesh.sampler_kwargs()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._train_loaders.track(dataloader) if self.lightning_module.trainer.training else dataloader

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
        if self.mesh is None and self.auto_layout:  # chosen now that the module and its data are set up
            adopt(self, choose_for(self, trainer))  # its sizes, configs and options, checked as a user's
            self._lay_out(own_layout=False)
        assert self.model is not None and self.accelerator is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        self._train_loaders.clear()
        self.model = self.precision_plugin.convert_module(self.model)
        self.parallel = parallelize_for_trainer(
            self.lightning_module, self.mesh, self.root_device, self.composition, self.precision_plugin, self.init_from,
            self.init_from_prefix, sync_batchnorm=compat.sync_batchnorm_requested(self))
        self.init_from = None  # loaded once: a later validate/test/predict keeps the trained weights
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.parallel.attach_optimizers(self.optimizers)
        self.setup_precision_plugin()

    @override
    def block_backward_sync(self) -> AbstractContextManager[None]:
        """``manual_backward`` inside accumulates this rank's gradients unsynchronized (DDP's ``no_sync``); the next
        one outside synchronizes all of them, and clipping or stepping before it raises."""
        return self.parallel.block_sync() if self.parallel is not None else nullcontext()

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
        step = ("training_step" if trainer.training else "test_step" if trainer.testing
                else "predict_step" if trainer.predicting else "validation_step")
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
StrategyRegistry.register(FourDStrategy.strategy_name, FourDStrategy,
                          description="4D parallelism (dp, pp, cp, tp) from lightning-4d")
