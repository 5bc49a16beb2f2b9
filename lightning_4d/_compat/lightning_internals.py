"""Lightning's and torchmetrics' private names that lightning-4d reaches: the strategy's process-group set-up and
mesh, the training loop's SIGTERM broadcast and data fetcher, ``load_from_checkpoint``'s loader, ModelCheckpoint's
link, metrics' states and counters, and Lightning's pair that saves and restores every random stream.

Split from :mod:`lightning_4d._compat` (which hands every name on) so that a Lightning or torchmetrics upgrade is
adapted in one file of their own; each entry says why no public API does the job.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from torch.distributed.device_mesh import DeviceMesh


# ---------------------------------------------------------------------------------------------- Lightning

# Lightning's reduce/gather over a group, the same ones its own strategies use for ``self.log(sync_dist=True)``.
sync_ddp_if_available = _sync_ddp_if_available
all_gather_ddp_if_available = _all_gather_ddp_if_available


def skip_sigterm_broadcast(trainer: Any) -> Callable[[], None]:
    """Lightning 2.6's training loop broadcasts rank 0's ``trainer.received_sigterm`` over the world before every
    batch and reads it on the host (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a blocking collective and a
    device read per step, which also lines every rank up at each step's start (a pipeline's stages can no longer
    overlap one step's end with the next one's start). Only Lightning's own SIGTERM handler sets that flag; the
    caller has replaced it with one whose signal travels in its own step agreement, so the broadcast would only
    ever carry 0. No public switch turns it off. Returns what puts it back."""
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        raise RuntimeError("lightning's training loop has no _broadcast_sigterm_tensor:"
                           " update lightning_4d/_compat/lightning_internals.py")
    loop._broadcast_sigterm_tensor = _no_sigterm_broadcast
    return lambda: loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def _no_sigterm_broadcast() -> None:
    """In place of Lightning's per-step SIGTERM broadcast while FaultTolerance's handler holds SIGTERM."""


def setup_distributed(strategy: Any, store: Optional[Callable[..., Optional[dist.Store]]] = None) -> None:
    """ModelParallelStrategy's process-group set-up (environment, backend, timeout), which the strategy reuses;
    ``store(rank, world_size, timeout)`` may give the store to make the default group on (Lightning's set-up
    finds the group made and keeps it)."""
    given = store(strategy.global_rank, strategy.world_size, strategy._timeout) if store is not None else None
    if given is not None and not dist.is_initialized():
        device = strategy.root_device
        dist.init_process_group(strategy._get_process_group_backend(), rank=strategy.global_rank,
                                world_size=strategy.world_size, timeout=strategy._timeout, store=given,
                                device_id=device if device.type != "cpu" else None)
    strategy._setup_distributed()


# ``LightningModule.load_from_checkpoint`` reads one file through ``lightning.pytorch.core.saving.pl_load`` (a
# private alias of fabric's ``_load``), which meets a directory, such as a lightning-4d checkpoint, with a bare
# IsADirectoryError. Wrapped once, so that a directory is refused with ``message(path)`` instead; a file loads as
# before.
def refuse_directories_in_load_from_checkpoint(message: Callable[[str], str]) -> None:
    from lightning.pytorch.core import saving

    original = saving.pl_load
    if getattr(original, "lightning_4d_wrapped", False):
        return

    def pl_load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and os.path.isdir(path_or_url):
            raise IsADirectoryError(message(os.fspath(path_or_url)))
        return original(path_or_url, *args, **kwargs)

    pl_load.lightning_4d_wrapped = True
    saving.pl_load = pl_load


# ``Trainer(sync_batchnorm=True)`` reaches a strategy only as its private ``_layer_sync`` plugin (Lightning's
# accelerator connector sets it on every ParallelStrategy; DDPStrategy applies it in its own setup).
def sync_batchnorm_requested(strategy: Any) -> bool:
    return getattr(strategy, "_layer_sync", None) is not None


def set_device_mesh(owner: Any, mesh: DeviceMesh) -> None:
    """What ``strategy.device_mesh`` and ``LightningModule.device_mesh`` return (their setters are private)."""
    owner._device_mesh = mesh


def fetches_inside_step(trainer: Any) -> bool:
    """Whether the training loop's data fetcher hands ``training_step`` the iterator (a step that takes
    ``dataloader_iter``): then whether a batch is the epoch's last is known only after the step."""
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

    return isinstance(getattr(trainer.fit_loop, "_data_fetcher", None), _DataLoaderIterDataFetcher)


def route_checkpoint_links(callbacks: list[Any], link: Callable[[Any, str, str], None]) -> None:
    """``ModelCheckpoint(save_last="link")`` links ``last`` with a static method of its own; routed per instance
    to ``link(trainer, target, path)``, so that the strategy makes the link once the target is complete."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint):
            if not callable(getattr(type(callback), "_link_checkpoint", None)):
                raise RuntimeError("lightning's ModelCheckpoint has no _link_checkpoint:"
                                   " update lightning_4d/_compat/lightning_internals.py")
            callback._link_checkpoint = link


# -------------------------------------------------------------------------------------------- torchmetrics

# Under pipelining only the last stage updates a metric; the other stages must still count the update (so
# ``compute`` does not warn and syncs), and ``forward``'s cached batch value must be the last stage's.
def metric_update_count(metric: Any) -> int:
    return metric._update_count


def count_metric_updates(metric: Any, count: int) -> None:
    metric._update_count += count
    metric._computed = None


def metric_forward_cache(metric: Any) -> Any:
    return metric._forward_cache


def set_metric_forward_cache(metric: Any, value: Any) -> None:
    metric._forward_cache = value


def train_dataloader(trainer: Any) -> Any:
    """The training dataloader as the module's (or data module's) hook returns it, before Lightning adds its
    sampler; the first one where there are several."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    loader = _request_dataloader(trainer.fit_loop._data_source)
    if hasattr(loader, "flattened"):  # a CombinedLoader
        loader = loader.flattened[0]
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    return loader


def init_optimizers(module: Any) -> list[Any]:
    """The optimizers ``module.configure_optimizers()`` returns, in any of the forms Lightning accepts, as Lightning
    reads them (``layout_trials`` steps a copy of the module with them); no public function normalizes them."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    return _init_optimizers_and_lr_schedulers(module)[0]


def metric_reductions(metric: Any) -> dict[str, Any]:
    """How torchmetrics reduces each state over processes: "sum", "mean", "max", "min", "cat", or the function
    (or None) given to ``add_state`` (kept in the private ``_reductions``)."""
    from torchmetrics.utilities import data

    names = {data.dim_zero_sum: "sum", data.dim_zero_mean: "mean", data.dim_zero_max: "max",
             data.dim_zero_min: "min", data.dim_zero_cat: "cat"}
    return {name: names.get(reduce, reduce) for name, reduce in metric._reductions.items()}


# Under pipelining a step's micro-batches update a metric one after another; its step value (what ``forward``
# returns and Lightning logs per step) is that of the whole batch. ``MetricOnBatch`` keeps a second set of the
# metric's states (named in the private ``_defaults``), reset per step and updated by the class's own ``update``
# with every micro-batch, and computes it with the class's own ``compute``: no synchronization (``forward``'s
# batch value is local too), no counters, and no copy of the module (a deep copy would meet process groups).
class MetricOnBatch:
    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.states = copy.copy(metric)  # its own attribute dict; the states are replaced by reset()
        self.reset()

    def reset(self) -> None:
        for name, default in self.metric._defaults.items():
            current = getattr(self.metric, name)
            value = default.detach().clone().to(current.device) if isinstance(default, torch.Tensor) else []
            setattr(self.states, name, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        type(self.metric).update(self.states, *args, **kwargs)

    def compute(self) -> Any:
        return type(self.metric).compute(self.states)


# Context parallelism's step check runs the user's step twice on a sample and must leave every metric as it
# was: torchmetrics has ``reset`` but no public way to save and restore a state (its ``metric_state`` is
# read-only), so the states named in ``_defaults`` and the counters beside them are copied and put back.
def metric_snapshot(metric: Any) -> dict[str, Any]:
    states = {name: value.clone() if isinstance(value, torch.Tensor) else list(value) if isinstance(value, list)
              else value for name, value in ((name, getattr(metric, name)) for name in metric._defaults)}
    return {"states": states, "_update_count": metric._update_count, "_forward_cache": metric._forward_cache,
            "_computed": metric._computed}


def restore_metric(metric: Any, snapshot: dict[str, Any]) -> None:
    for name, value in snapshot["states"].items():
        setattr(metric, name, value)
    for name in ("_update_count", "_forward_cache", "_computed"):
        setattr(metric, name, snapshot[name])


# ------------------------------------------------------------------------------------------ random streams

# Every random stream a step may draw from (torch's, CUDA's, numpy's, Python's), saved and restored around the
# step check's runs so that training draws as if they had not run: Lightning's own pair, private.
def rng_states() -> dict[str, Any]:
    return _collect_rng_states(include_cuda=torch.cuda.is_available())


def set_rng_states(states: dict[str, Any]) -> None:
    _set_rng_states(states)
