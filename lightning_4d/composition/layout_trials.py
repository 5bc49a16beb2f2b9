"""``FourDStrategy(layout="auto", layout_trials=k)``: the ``k`` layouts predicted fastest each run a few steps of the
user's own module, and the fastest measured is chosen.

The step-time model ranks every layout without running one (:mod:`lightning_4d.planner.step_time`); where its
figures are off (per-operation costs of tensor and context parallelism are not in it, and CPU ranks that share
cores are hard to predict) a trial settles the order among the best few. Each trial, on every rank, takes the
strategy's own path: a copy of the module (``copy.deepcopy``; a meta-built module copies as meta and the layout
initializes its shards), converted by the precision plugin and laid out by
:func:`~lightning_4d.composition.parallelize.parallelize` over the candidate's mesh with the candidate's
checkpointing and micro-batches, the optimizers its ``configure_optimizers`` returns, then one warm-up and
:data:`STEPS` timed steps on the first training batch: the training step, backward, the gradient synchronization
and the optimizer step, as Lightning's automatic optimization runs them (the copy's ``self.log`` and
``self.log_dict`` do nothing). A trial's time is the slowest rank's median step, agreed in one reduction after
the trials, so every rank chooses the same layout. The copy and its optimizers are dropped after each trial; the meshes are kept (one
per layout and process, the chosen one reused by training).

Training sees nothing of it: the module itself is never touched, the first batch is read with the random state
put back, and the random state is restored after the trials. A trial holds its copy's shards beside the module,
so only candidates that fit beside it are tried (:func:`lightning_4d.composition.auto_layout.trials_beside`).
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from lightning_4d import _compat as compat
from lightning_4d.arguments import positive
from lightning_4d.planner.estimate import Estimate

STEPS = 2  # timed steps per trial, after one warm-up step


def check_layout_trials(trials: Any, automatic: bool) -> int:
    """``layout_trials`` checked at construction."""
    positive("layout_trials", trials, "layouts (of those predicted fastest) that run a few steps each before the"
             " fastest measured is chosen; 1: the prediction alone", integer=True)
    if trials > 1 and not automatic:
        raise ValueError(f"layout_trials={trials} tries the layouts that layout=\"auto\" ranks: set layout=\"auto\""
                         " too, or leave layout_trials at 1.")
    return trials


def layout_dims(strategy: Any, layout: Any) -> Any:
    """The strategy's ``ParallelDims`` with ``layout``'s sizes (its own ``ep``)."""
    from lightning_4d.parallel_dims import ParallelDims

    return ParallelDims.resolve(strategy.world_size, dp=layout.dp, pp=layout.pp, cp=layout.cp, tp=layout.tp,
                                dp_shard=layout.dp_shard, ep=strategy.requested_sizes["ep"])


def layout_options(strategy: Any, estimate: Estimate) -> dict[str, Any]:
    """``parallelize``'s options for the strategy's composition with ``estimate``'s sizes, checkpointing and
    micro-batches."""
    from lightning_4d.memory.activation_checkpointing import ActivationCheckpointConfig

    layout, training = estimate.layout, estimate.training
    return {**strategy.composition,
            "pipeline": replace(strategy.pp_config, pp=layout.pp, microbatches=training.microbatches),
            "tensor": replace(strategy.tp_config, tp=layout.tp), "context": replace(strategy.cp_config, cp=layout.cp),
            "activation_checkpointing": ActivationCheckpointConfig(training.activation_checkpointing,
                                                                   training.activation_checkpointing_every)}


def check_trials_possible(module: Any, trials: int) -> None:
    """A module the trials cannot step is refused before any trial's collective."""
    if trials > 1 and not module.automatic_optimization:
        raise ValueError(f"layout_trials={trials}: {type(module).__name__} optimizes manually"
                         " (automatic_optimization=False), and a trial steps the module as Lightning's automatic"
                         " optimization does. Use layout_trials=1 (the predicted fastest layout) or give the sizes.")


def time_layouts(strategy: Any, trainer: Any, candidates: list[Estimate], batch: Any) -> list[float]:
    """This rank's median step time of each candidate (collective: every rank runs every trial in order)."""
    states = compat.rng_states()
    # Each trial's copy is collected after it (its module graph holds reference cycles); with the objects from
    # before the trials frozen, that collection scans the trial's own objects, not the whole process (a full
    # one held the interpreter lock for 0.18 s of CPU at 466k objects, longer where ranks share cores).
    gc.freeze()
    try:
        return [_trial(strategy, trainer, estimate, batch) for estimate in candidates]
    finally:
        gc.unfreeze()
        compat.set_rng_states(states)


def _twin(module: Any, trainer: Any) -> Any:
    """A deep copy of ``module`` attached to its trainer (a LightningModule's copy leaves it out), logging nothing."""
    try:
        twin = copy.deepcopy(module, {id(trainer): trainer})
    except Exception as error:  # noqa: BLE001  anything the module holds may refuse to be copied
        raise ValueError(f"layout_trials lays out a copy of {type(module).__name__} per trial, and copy.deepcopy of"
                         f" it failed ({type(error).__name__}: {error}). Make the module copyable or use"
                         " layout_trials=1.") from error

    def dropped(*args: Any, **kwargs: Any) -> None:
        return None

    twin.trainer = trainer  # configure_optimizers may read it (estimated_stepping_batches)
    twin.log = twin.log_dict = dropped
    return twin


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trial(strategy: Any, trainer: Any, estimate: Estimate, batch: Any) -> float:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from lightning_4d.composition.parallelize import parallelize
    from lightning_4d.data_parallel.fsdp import param_dtype_for

    device, plugin = strategy.root_device, strategy.precision_plugin
    mesh = layout_dims(strategy, estimate.layout).build(device.type)
    twin = plugin.convert_module(_twin(strategy.lightning_module, trainer))
    parallel = parallelize(twin, mesh, device, **layout_options(strategy, estimate),
                           param_dtype=param_dtype_for(str(getattr(plugin, "precision", ""))))
    optimizers = compat.init_optimizers(twin)
    parallel.attach_optimizers(optimizers)
    sharded = parallel.shard_batch(move_data_to_device(batch, device), "training_step", host=batch)

    def closure() -> Any:
        with plugin.train_step_context():
            output = parallel.step("training_step", (sharded, 0), {}, gradients_zeroed=True)
        loss = output.get("loss") if isinstance(output, dict) else output
        parallel.backward(loss.backward)
        return loss

    timings = []
    for step in range(1 + STEPS):
        _synchronize(device)
        started = time.perf_counter()
        optimizers[0].step(parallel.synchronizing(optimizers[0], closure))
        optimizers[0].zero_grad(set_to_none=True)
        _synchronize(device)
        if step:
            timings.append(time.perf_counter() - started)
    parallel.remove()
    del twin, parallel, optimizers, sharded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(timings)
