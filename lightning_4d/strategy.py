"""``FourDStrategy``: Lightning hooks translated into the per-dimension components.

The strategy holds no parallel mechanics of its own. It resolves and validates the layout
(:class:`~lightning_4d.parallel_dims.ParallelDims`), builds the mesh, hands the user's module to the
components, and routes Lightning's collectives to the group where ranks hold different data.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d import checkpoint
from lightning_4d.faults import report_failure
from lightning_4d.data_parallel import DEFAULT_BUCKET_MB, GradientBuckets
from lightning_4d.parallel_dims import ParallelDims, Size
from lightning_4d.resumable_loader import ResumableDataLoader, make_resumable

DEFAULT_TIMEOUT = timedelta(minutes=10)


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
        self.parallel_dims: Optional[ParallelDims] = None
        self._dp_cp_mesh: Optional[DeviceMesh] = None
        self._grad_buckets: dict[int, GradientBuckets] = {}
        self._armed: Optional[GradientBuckets] = None
        self._train_loaders: list[object] = []
        self._step_components: list[Any] = []  # objects with a ``step_context()`` context manager

    # ----------------------------------------------------------------------------------------- layout

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Runs at Trainer construction in the launching process: bad sizes fail before any process starts.
        self.parallel_dims = ParallelDims.resolve(self.num_nodes * self.num_processes, **self._sizes)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        assert self.parallel_dims is not None
        self._device_mesh, self._dp_cp_mesh = self.parallel_dims.build_mesh(self.root_device.type)
        rank_zero_info(self.layout_table())
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def layout_table(self) -> str:
        """Every rank with its (dp, pp, cp, tp) coordinates and the members of its groups."""
        assert self.parallel_dims is not None
        return self.parallel_dims.layout_table()

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one dim (``dp``, ``pp``, ``cp``, ``tp``) or of the gradient group ``dp_cp``."""
        if name == "dp_cp":
            return self._dp_cp_mesh.get_group()
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

    # ------------------------------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._train_loaders.clear()
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_metrics_over_replicas()
        if self.init_from is not None:
            checkpoint.load_weights(self.init_from, self.model, strict=self.lightning_module.strict_loading)
            self.init_from = None  # once: a later validate/test/predict keeps the trained weights
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._build_grad_buckets()
        self.setup_precision_plugin()

    def _sync_metrics_over_replicas(self) -> None:
        """torchmetrics sync over the world by default; ranks of one replica hold the same state."""
        from torchmetrics import Metric

        for metric in self.lightning_module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = self.group("dp")

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
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _step_context(self) -> Iterator[None]:
        """What every call of a user step method runs inside: each model-parallel component's context
        (context-parallel attention, loss-parallel cross entropy, ...), entered in registration order."""
        with ExitStack() as stack:
            for component in self._step_components:
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
            buckets.begin()
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
        report_failure(self.global_rank, exception)

    @override
    def teardown(self) -> None:
        self._remove_grad_buckets()
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
