"""``FourDStrategy``: Lightning's hooks mapped onto one composition.

The strategy validates the layout (:class:`~lightning_4d.parallel_dims.ParallelDims`) before any process
starts, builds the mesh, hands the module to :func:`~lightning_4d.composition.parallelize.parallelize`, and from then on
forwards each hook to the :class:`~lightning_4d.composition.parallelize.ParallelModel` it got back: steps, backward,
gradient sync, clipping, checkpoints. Lightning's own collectives (``reduce``, ``all_gather``) go to the
group whose ranks hold different data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d import _compat as compat
from lightning_4d import checkpoint
from lightning_4d.memory.activation_checkpointing import ActivationCheckpointConfig
from lightning_4d.arguments import positive, refuse_unknown
from lightning_4d.callbacks import PredictionWriters, check_weight_averaging
from lightning_4d.checkpoint.resumable_loader import TrainLoaders
from lightning_4d.memory.compile import CompileConfig
from lightning_4d.context_parallel import ContextParallelConfig
from lightning_4d.context_parallel.config import DEFAULT_CHECK_TOKENS
from lightning_4d.data_parallel import (DEFAULT_BUCKET_MB, check_reshard_after_forward, check_shard_units,
                                        param_dtype_for)
from lightning_4d.data_parallel.batchnorm import batchnorm_layers, restore_batchnorm, sync_batchnorm
from lightning_4d.observability.desync import DesyncMonitor
from lightning_4d.faults import attach as attach_fault_tolerance, report_failure
from lightning_4d.faults.report import destroy_process_groups_at_exit
from lightning_4d.faults.timeouts import DEFAULT_INIT_TIMEOUT, DEFAULT_TIMEOUT, CollectiveTimeouts
from lightning_4d.launcher import ForkLauncher, check_start_method
from lightning_4d.parallel_dims import ParallelDims, ParallelMesh, Size, check_ep_size
from lightning_4d.composition.parallelize import ParallelModel, make_plans, parallelize, parallelized
from lightning_4d.pipeline import PipelineConfig
from lightning_4d.observability.telemetry import Telemetry
from lightning_4d.numerics.token_losses import check_normalization
from lightning_4d.tensor_parallel import TensorParallelConfig

def _step_method(name: str, precision_context: str) -> Callable[..., Any]:
    def step(self: FourDStrategy, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        with getattr(self.precision_plugin, precision_context)():
            return self.parallel.step(name, args, kwargs, predicting=trainer.predicting,
                                      accumulate_grad_batches=trainer.accumulate_grad_batches,
                                      gradients_zeroed=name == "training_step" and self._gradients_zeroed)
    step.__name__ = step.__qualname__ = name
    return step


class FourDStrategy(ModelParallelStrategy):
    """Data, tensor/sequence, context and pipeline parallelism for an unchanged LightningModule.

    Args:
        dp, pp, cp, tp: data-parallel replicas, pipeline stages, context-parallel ranks splitting each sequence,
            tensor-parallel ranks splitting each layer; ``dp="auto"`` takes what the others leave of the world.
        dp_shard, reshard_after_forward, reduce_scatter_every_batch: ranks that shard each replica's parameters,
            gradients and optimizer state (FSDP2; HSDP with ``dp > 1``; ``"auto"`` fills the world), whether a
            block frees its gathered weights after forward (``"auto"``: all but the last), and whether every
            batch of ``accumulate_grad_batches`` reduce-scatters (less memory); see :mod:`lightning_4d.data_parallel.fsdp`.
        shard_units: FSDP's units: ``"blocks"`` (one per block, the rest in the root) or ``"modules"`` (also one per
            weight matrix inside a block and per module around the blocks: least memory, more collectives).
        ep: expert parallelism: each mixture-of-experts layer's experts split over ``ep`` ranks borrowed from
            ``dp x cp``, tokens sent to their experts by all-to-all; see :mod:`lightning_4d.expert_parallel`.
        bucket_mb: size of a gradient all-reduce bucket in megabytes.
        timeout, init_timeout: how long a collective may wait before the waiting ranks fail and print what
            every rank was last doing: once training runs (2 minutes), and while the run starts and around
            checkpoint saves and loads (10 minutes); see ``docs/troubleshooting.md``.
        process_group_backend: ``"nccl"``/``"gloo"``; by default chosen from the device.
        init_from, init_from_prefix: weights to start from, in any layout, each rank reading only what it holds:
            a Hugging Face directory (``save_pretrained``), a torch DCP directory, a lightning-4d checkpoint
            directory, a Lightning checkpoint file, or a file with a plain ``state_dict``; and the module path
            under which the file's keys are the module's (e.g. ``"model."``; ``None``: found automatically).
        cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers, cp_document_key: see
            :class:`~lightning_4d.context_parallel.config.ContextParallelConfig` (``None``: found by name).
        cp_check, cp_check_tokens: on the first training, validation and test batch, run the step on a sample (at
            most ``cp_check_tokens`` tokens per sequence) sharded and whole, and refuse a difference from one
            process before any weight changes; see :mod:`lightning_4d.context_parallel.step_check`.
        pp_schedule, pp_microbatches, pp_blocks, pp_split_points, pp_virtual_stages: the schedule (``gpipe``,
            ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``, ``zbv_zero_bubble``,
            ``dualpipev``), micro-batches (``None``: ``2 * pp``), the block list to cut, where stages begin and
            stages per rank; see :class:`~lightning_4d.pipeline.PipelineConfig`.
        tp_plan: ``"auto"`` (attention, MLP and vocabulary found by name and shape), ``"none"``, or a mapping of
            module FQN globs to ``colwise``/``rowwise``/``sequence_parallel``/``replicate`` or ``{style, input,
            output, divide}``, merged over the automatic plan; ignored if ``configure_model`` made DTensors.
        sequence_parallel: keep activations between attention and MLP sharded on the sequence (not with pp).
        tp_self_check: on the first training batch, compare one sharded block of each type with a whole copy.
        tp_strict: raise instead of warning when the plan shards under 90% of the parameters outside the
            embedding and head.
        loss_parallel: cross entropy on the LM head's logits without gathering the vocabulary.
        loss_normalization: ``"tokens"``: a token-mean ``cross_entropy``/``nll_loss`` (``ignore_index``, class
            weights; a Hugging Face model's ``labels=`` loss) weighs every valid target of the batch, and of the
            ``accumulate_grad_batches`` window, once, whichever rank holds it, as one process on the window's
            batches does; ``"batch"``: the same within each batch, the window's batches averaged (Lightning's
            accumulation); ``"replica"``: each rank's own mean, averaged (DDPStrategy's); see
            :mod:`lightning_4d.numerics.token_losses`.
        activation_checkpointing, activation_checkpointing_every: ``"none"``, ``"full"``, ``"every_n"`` or
            ``"selective"``, and the ``n`` of ``"every_n"``; see :mod:`lightning_4d.memory.activation_checkpointing`.
        compile: ``torch.compile`` each block (``True``, or a dict of ``backend``/``mode``/``fullgraph``/
            ``options``); see :mod:`lightning_4d.memory.compile`.
        debug, debug_steps: for the first ``debug_steps`` steps, check that a replica's ranks get identical
            batches, keep replicated weights bit-identical and issue the same collectives.
        telemetry: add the :class:`~lightning_4d.observability.telemetry.Telemetry` callback (tokens/s, MFU, memory,
            communication time per dimension, pipeline bubble).
        broadcast_buffers: broadcast buffers (BatchNorm statistics, ...) within each replica group before every
            training step, as DDP does.
        start_method: ``"popen"`` runs the script again per rank (as DDP does); ``"fork"`` (CPU) forks them.
    """

    strategy_name = "fourd"

    def __init__(
        self,
        dp: Size = "auto",
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        dp_shard: Size = 1,
        ep: int = 1,
        reshard_after_forward: Union[bool, Literal["auto"]] = "auto",
        reduce_scatter_every_batch: bool = False,
        shard_units: Literal["blocks", "modules"] = "blocks",
        bucket_mb: float = DEFAULT_BUCKET_MB,
        timeout: timedelta = DEFAULT_TIMEOUT,
        init_timeout: timedelta = DEFAULT_INIT_TIMEOUT,
        process_group_backend: Optional[str] = None,
        init_from: Optional[str] = None,
        init_from_prefix: Optional[str] = None,
        cp_comm: Literal["ring", "allgather", "a2a"] = "ring",
        cp_seq_dim: int = 1,
        cp_batch_keys: Optional[list[Union[str, int]]] = None,
        cp_position_modules: Optional[list[str]] = None,
        cp_buffers: Optional[list[str]] = None,
        cp_document_key: Optional[str] = None,
        cp_check: bool = True,
        cp_check_tokens: int = DEFAULT_CHECK_TOKENS,
        pp_schedule: str = "1f1b",
        pp_microbatches: Optional[int] = None,
        pp_blocks: Optional[str] = None,
        pp_split_points: Optional[list[int]] = None,
        pp_virtual_stages: Optional[int] = None,
        tp_plan: Union[str, dict, None] = "auto",
        sequence_parallel: bool = False,
        tp_self_check: bool = True,
        tp_strict: bool = False,
        loss_parallel: bool = True,
        loss_normalization: Literal["tokens", "batch", "replica"] = "tokens",
        activation_checkpointing: str = "none",
        activation_checkpointing_every: int = 2,
        compile: Union[bool, dict] = False,
        debug: bool = False,
        debug_steps: int = 2,
        telemetry: bool = False,
        broadcast_buffers: bool = True,
        start_method: Literal["popen", "fork"] = "popen",
        **unknown: Any,
    ) -> None:
        refuse_unknown(FourDStrategy.__init__, unknown)
        self.collective_timeouts = CollectiveTimeouts(init_timeout, timeout)  # read by FaultTolerance
        super().__init__(process_group_backend=process_group_backend, timeout=self.collective_timeouts.init)
        self.timeout = self.collective_timeouts.train
        positive("bucket_mb", bucket_mb, "megabytes (default 25)")
        self._sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "dp_shard": dp_shard, "ep": ep}
        ParallelDims.check_sizes(dp, pp, cp, tp, dp_shard)
        check_ep_size(ep)
        check_reshard_after_forward(reshard_after_forward)
        self.reshard_after_forward, self.bucket_mb, self.init_from = reshard_after_forward, float(bucket_mb), init_from
        self.init_from_prefix = init_from_prefix
        self.reduce_scatter_every_batch = bool(reduce_scatter_every_batch)
        self.shard_units = shard_units
        # Typed per-dimension options, each validated on construction (before any process starts).
        self.cp_config = ContextParallelConfig(cp, cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers,
                                               cp_document_key, cp_check, cp_check_tokens)
        self.pp_config = PipelineConfig(pp, pp_schedule, pp_microbatches, pp_blocks, pp_split_points, pp_virtual_stages)
        self.tp_config = TensorParallelConfig(tp, tp_plan, sequence_parallel, loss_parallel, tp_self_check, tp_strict)
        self.tp_config.check_with_pipeline(self.pp_config.pp)
        check_normalization(loss_normalization)
        self.loss_normalization = loss_normalization
        self.ac_config = ActivationCheckpointConfig(activation_checkpointing, activation_checkpointing_every)
        self.compile_config = CompileConfig.build(compile)
        check_shard_units(shard_units, self.pp_config.pp, self.tp_config.tp, self.compile_config.enabled)
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
        self._writers = PredictionWriters()

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
        self.parallel_dims = ParallelDims.resolve(self.num_nodes * self.num_processes, **self._sizes)

    @override
    def setup_environment(self) -> None:
        assert self.parallel_dims is not None and self.lightning_module is not None
        dims = self.parallel_dims
        check_weight_averaging(self.lightning_module.trainer.callbacks,
                               {"tp": dims.tp, "dp_shard": dims.dp_shard, "pp": dims.pp, "ep": dims.ep})
        if (dims.pp_enabled or dims.dp_shard_enabled or dims.ep_enabled) and parallelized(
                self.lightning_module) is None and not is_overridden("configure_model", self.lightning_module):
            # A module the pipeline cannot cut, or that sharding refuses, fails here, before any process group.
            make_plans(self.lightning_module, self.parallel_dims, pipeline=self.pp_config, tensor=self.tp_config)
        compat.setup_distributed(self)
        destroy_process_groups_at_exit()
        self.mesh = self.parallel_dims.build(self.root_device.type)
        compat.set_device_mesh(self, self.mesh.mesh)
        if self.global_rank == 0:  # the table is O(world) lines: only the rank that prints it builds it
            rank_zero_info(self.layout_table())
        compat.set_device_mesh(self.lightning_module, self.mesh.mesh)
        if self.debug and self._desync is None:
            self._desync = DesyncMonitor(self.mesh, self.debug_steps,
                                         timeout=min(self.timeout, timedelta(seconds=60)))
        trainer = self.lightning_module.trainer
        if self.telemetry and not any(isinstance(c, Telemetry) for c in trainer.callbacks):
            trainer.callbacks.append(Telemetry())
        attach_fault_tolerance(self)  # preemption, heartbeats, uneven data, batch shapes, buffers

    def layout_table(self) -> str:
        """Every rank with its (dp, pp, cp, tp) coordinates and the members of its groups."""
        assert self.parallel_dims is not None
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
    def on_predict_start(self) -> None:
        """Prediction writers write on one rank per replica: the tp and cp rank 0 of the last stage."""
        super().on_predict_start()
        mesh = self.mesh
        self._writers.start(self.lightning_module.trainer.callbacks, writes=mesh.local_rank("tp") == 0
                            and mesh.local_rank("cp") == 0 and mesh.local_rank("pp") == self.parallel_dims.pp - 1)

    @override
    def on_predict_end(self) -> None:
        self._writers.end()
        super().on_predict_end()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        module = self.lightning_module
        self._train_loaders.consumed(batch_idx + 1, module.trainer.num_training_batches)
        # Lightning's own rule: automatic optimization zeroes the gradients right after the first training_step
        # of each accumulation window (unless the module replaces optimizer_zero_grad).
        self._gradients_zeroed = (module.automatic_optimization and not is_overridden("optimizer_zero_grad", module)
                                  and batch_idx % module.trainer.accumulate_grad_batches == 0)
        if self._desync is not None:
            self._desync.on_step_start(self.lightning_module, self.lightning_module.trainer.global_step)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        self._train_loaders.clear()
        self.model = self.precision_plugin.convert_module(self.model)
        first = parallelized(self.lightning_module) is None
        # With init_from (strict), the load right below fills every weight: parallelize neither broadcasts rank
        # 0's nor initializes a meta-built module's (only what no checkpoint holds: non-persistent buffers).
        loading = self.init_from is not None and self.lightning_module.strict_loading
        self.parallel = parallelize(self.lightning_module, self.mesh, self.root_device, pipeline=self.pp_config,
                                    tensor=self.tp_config, context=self.cp_config,
                                    activation_checkpointing=self.ac_config, compile=self.compile_config,
                                    bucket_mb=self.bucket_mb, reshard_after_forward=self.reshard_after_forward,
                                    reduce_scatter_every_batch=self.reduce_scatter_every_batch,
                                    param_dtype=param_dtype_for(str(getattr(self.precision_plugin, "precision", ""))),
                                    loss_normalization=self.loss_normalization, loading=loading,
                                    shard_units=self.shard_units)
        if first and self.global_rank == 0 and self.parallel.describe():
            rank_zero_info(self.parallel.describe())
        self._install_clipping()
        self._batchnorm_statistics(first)
        if self.init_from is not None:
            self.parallel.load_weights(self.init_from, strict=self.lightning_module.strict_loading,
                                       prefix=self.init_from_prefix)
            self.init_from = None  # once: a later validate/test/predict keeps the trained weights
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.parallel.attach_optimizers(self.optimizers)
        self.setup_precision_plugin()

    def _batchnorm_statistics(self, first: bool) -> None:
        """``Trainer(sync_batchnorm=True)``: BatchNorm layers normalize with the statistics of the whole batch, over
        dp x cp (:mod:`lightning_4d.data_parallel.batchnorm`, CPU and GPU); without it, a model with BatchNorm whose
        batch is split says once that each replica keeps its own statistics, as under DDPStrategy."""
        dims = self.parallel_dims
        layers = batchnorm_layers(self.lightning_module)
        if not layers or dims.dp * dims.dp_shard * dims.cp == 1:
            return
        if compat.sync_batchnorm_requested(self):
            sync_batchnorm(self.lightning_module, self.mesh.group("dp_cp"))
        elif first:
            rank_zero_warn(f"{len(layers)} BatchNorm layers ({layers[0][0]}, ...) normalize with the statistics of the"
                           f" part of the batch each rank holds (dp={dims.dp * dims.dp_shard}, cp={dims.cp}), as under"
                           " DDPStrategy, not the whole batch's as one process does: Trainer(sync_batchnorm=True) gives"
                           " them the whole batch's.")

    def _install_clipping(self) -> None:
        """Clipping on the precision plugin (Lightning's ``gradient_clip_val`` and ``self.clip_gradients``) that
        refuses gradients a blocked manual backward left unsynchronized, and, under tp, pp or dp_shard, clips by
        the norm over the whole model: Lightning's own sees this rank's shards and stage only."""
        plugin, base = self.precision_plugin, type(self.precision_plugin)
        dims = self.parallel_dims
        whole_model = dims.tp_enabled or dims.pp_enabled or dims.dp_shard_enabled or dims.ep_enabled

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            self.parallel.check_synchronized("clip_gradients")
            if whole_model:
                self.parallel.clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val))
            else:
                base.clip_grad_by_norm(plugin, optimizer, clip_val)

        def clip_grad_by_value(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            # Elementwise, so each rank clamps what it holds; one tensor at a time: torch's foreach kernels
            # refuse a list mixing tensor-parallel DTensors with plain tensors.
            self.parallel.check_synchronized("clip_gradients")
            torch.nn.utils.clip_grad_value_(list(plugin.main_params(optimizer)), float(clip_val), foreach=False)

        plugin.clip_grad_by_norm, plugin.clip_grad_by_value = clip_grad_by_norm, clip_grad_by_value

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Under manual optimization, ``manual_backward`` inside accumulates this rank's gradients without
        synchronizing them, for gradient accumulation without a sync per batch (as DDP's ``no_sync``; also entered
        by ``optimizer.toggle_model(sync_grad=False)``). The next ``manual_backward`` outside synchronizes all
        that accumulated; clipping or stepping before one raises. Lightning's automatic loop enters it on
        accumulation micro-steps, which synchronize nothing here anyway."""
        with self.parallel.block_sync() if self.parallel is not None else nullcontext():
            yield

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        trainer = self.lightning_module.trainer
        if self._desync is not None and trainer.training:
            self._desync.check_batch(batch, trainer.global_step)
        # Prediction outputs are per token or per sequence, so prediction runs on whole sequences.
        if trainer.predicting:
            return batch
        step = "training_step" if trainer.training else "test_step" if trainer.testing else "validation_step"
        return self.parallel.shard_batch(batch, step)

    # The module's step methods, run by the ParallelModel inside the precision plugin's context.
    training_step = _step_method("training_step", "train_step_context")
    validation_step = _step_method("validation_step", "val_step_context")
    test_step = _step_method("test_step", "test_step_context")
    predict_step = _step_method("predict_step", "predict_step_context")

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
        """Reduce over the data-parallel replicas: other ranks of a replica hold the same value already."""
        if isinstance(tensor, Tensor):
            return compat.sync_ddp_if_available(tensor, group or self._replica_group(), reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather one value per data-parallel replica, as DDP would with that many processes."""
        return compat.all_gather_ddp_if_available(tensor, group=group or self._replica_group(), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)

    def _replica_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("dp") if self.mesh is not None else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.parallel.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.parallel.optimizer_state(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("FourDStrategy.save_checkpoint(storage_options=...) is not supported: it writes with"
                            " torch.distributed.checkpoint, not a CheckpointIO.")
        with self.collective_timeouts.long():
            checkpoint.save(checkpoint_dict, self.broadcast(str(filepath)), is_writer=self.global_rank == 0)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with self.collective_timeouts.long():
            return self.parallel.load(self.broadcast(str(checkpoint_path)), self.optimizers,
                                      strict=self.lightning_module.strict_loading)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            checkpoint.remove(filepath)

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_failure(self.global_rank, exception, self.world_size)

    @override
    def teardown(self) -> None:
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
