"""``FourDStrategy(layout="auto")``: the layout chosen for the user, by predicted time.

At the strategy's ``setup`` (the module built, the data module set up, before anything is laid out), every rank
reads the same inputs and reaches the same choice:

* the model's sizes from the module (:meth:`~lightning_4d.planner.Model.from_module`; a meta-built module
  costs no memory), the first training batch's shape (``batch x sequence`` of its token tensor; rank 0's, read
  with the random state put back, so that training draws what it would have drawn), Lightning's precision, and
  AdamW's state (the most any usual optimizer keeps: the budget is never too small for the optimizer);
* the machine, calibrated on the run's own process groups (:mod:`lightning_4d.planner.calibration`; cached);
* the memory per device: ``memory_per_device``, else the device's free memory on GPU, or the machine's memory
  shared by its ranks on CPU (the smallest over the ranks).

Candidates are every layout of the world that keeps the sizes the user gave (a size other than its default),
whose plans the strategy makes without refusing them (the pipeline's cut, tensor parallelism's plan, context
parallelism's reach; :func:`~lightning_4d.composition.plans.make_plans`), and whose predicted peak fits.
Context parallelism is considered only when no layout without it fits: whether a module's step is exact under cp
is known only at its first batch (the step check), and a refusal there would end the run. Activation
checkpointing and the pipeline's micro-batches are part of each candidate (the planner's
:func:`~lightning_4d.planner.ranking.plan`). The dataloader's batch is per replica, so a layout with more
replicas trains more samples per step: candidates are ranked by predicted time per sample. With
``layout_trials=k`` the first k of them each run a few steps of a copy of the module, and the fastest measured per
sample is chosen (:mod:`lightning_4d.composition.layout_trials`). A trial's copy is laid out beside the module as
it is held (whole where it was built whole; nothing where it was built on the meta device), so candidates are
tried in order up to the first whose predicted memory does not fit beside it; rank 0 says so, and with fewer than
two left the prediction alone chooses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_4d.composition.layout_trials import (STEPS, check_layout_trials, check_trials_possible, layout_dims,
                                                   layout_options, time_layouts)
from lightning_4d.planner import Layout, Model, PlanError, Training, all_layouts, layout_problems
from lightning_4d.planner.estimate import Estimate, _format_bytes
from lightning_4d.planner.ranking import _judged, _no_fit_message, _rank, runnable_variants
from lightning_4d.planner.step_time import Machine

DEFAULT_SIZES = {"dp": "auto", "pp": 1, "cp": 1, "tp": 1, "dp_shard": 1}


@dataclass
class Choice:
    """The chosen layout, the training it was predicted for (checkpointing, micro-batches) and every candidate
    that fits, best first."""

    estimate: Estimate
    candidates: list[Estimate]
    machine: Machine
    measured: dict[Layout, float] = field(default_factory=dict)  # layout_trials: the slowest rank's median step

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    def tried(self, tried: list[Estimate], seconds: list[float]) -> "Choice":
        """``tried`` measured at ``seconds`` (every rank's same figures): the fastest per sample wins."""
        measured = {est.layout: step for est, step in zip(tried, seconds)}
        best = min(tried, key=lambda est: measured[est.layout] / est.training.global_batch)
        return replace(self, estimate=best, measured=measured)

    @property
    def training(self) -> Training:
        return self.estimate.training

    def describe(self, top: int = 5) -> str:
        why = (f"the fastest per sample of the {len(self.measured)} predicted fastest, each measured over"
               f" {STEPS} steps of this module" if self.measured else "predicted fastest per sample")
        lines = [f"[lightning-4d] layout=\"auto\" chose {self.layout} (activation_checkpointing="
                 f"{self.training.activation_checkpointing!r}, pp micro-batches {self.training.microbatches or 'default'}):"
                 f" {why}; predicted {self.estimate.step.total:.3g} s per step of {self.training.global_batch} samples,"
                 f" {_format_bytes(self.estimate.memory['total'])} per device. Step time predicted for"
                 f" {self.machine.source}. Candidates (predicted time per sample, best first):"]
        for est in self.candidates[:max(top, len(self.measured))]:
            measured = (f"  measured step {self.measured[est.layout]:.3g} s"
                        f" ({self.measured[est.layout] / est.training.global_batch * 1e3:.2f} ms/sample)"
                        if est.layout in self.measured else "")
            lines.append(f"  {est.layout}  ac={est.training.activation_checkpointing:<9}"
                         f" {est.step.total / est.training.global_batch * 1e3:8.2f} ms/sample"
                         f"  step {est.step.total:.3g} s  memory {_format_bytes(est.memory['total'])}"
                         f"  (largest part: {est.step.dominant()}){measured}")
        if len(self.candidates) > max(top, len(self.measured)):
            lines.append(f"  ... and {len(self.candidates) - max(top, len(self.measured))} more")
        return "\n".join(lines)


def fixed_sizes(sizes: dict[str, Any]) -> dict[str, int]:
    """The sizes the user gave (numbers other than their defaults), kept by the search."""
    return {name: value for name, value in sizes.items()
            if name in DEFAULT_SIZES and value not in (DEFAULT_SIZES[name], "auto")}


def choose(model: Model, per_replica_batch: int, seq_len: int, training: Training, world: int,
           fixed: dict[str, int], memory_per_device: float, machine: Machine,
           refused: Optional[Any] = None) -> Choice:
    """The fastest layout per sample of those that fit (see the module docstring). ``training``: the options the
    user fixed (precision, schedule, checkpointing...); its batch and sequence are replaced per layout.
    ``refused(layout)``: the strategy's refusal of a layout for this module, or None."""
    kept = [layout for layout in all_layouts(world) if all(getattr(layout, name) == size
                                                             for name, size in fixed.items())]
    if not kept:
        raise PlanError(f"layout='auto' keeps the sizes given ({fixed}), and no layout of {world} processes has"
                        " them: change those sizes or the number of processes.")
    judged, reasons = [], {}
    for layout in kept:
        trained = replace(training, seq_len=seq_len, global_batch=per_replica_batch * layout.data_parallel)
        options = runnable_variants(model, trained, layout, explore=True)
        problems = layout_problems(model, trained, layout) if not options else []
        if not problems and refused and (reason := refused(layout)):
            problems = [reason]
        if problems:
            reasons[layout] = problems
            continue
        judged.append(min((_judged(model, v, layout, "meta", memory_per_device, machine) for v in options),
                          key=_rank))
    if not judged:
        text = "; ".join(f"{layout}: {' '.join(problems)}" for layout, problems in list(reasons.items())[:6])
        raise PlanError(f"layout='auto' found no layout of {world} processes this module can run: {text}")
    fitting = [est for est in judged if est.fits]
    if not fitting:
        raise PlanError(f"layout='auto': {_no_fit_message(judged, memory_per_device, training)} Or set"
                        " memory_per_device if the budget assumed is wrong.")
    without_cp = [est for est in fitting if est.layout.cp == 1]
    ranked = sorted(without_cp or fitting, key=lambda est: (est.step.total / est.training.global_batch,
                                                            est.memory["total"]))
    return Choice(ranked[0], ranked, machine)


def first_batch(loader: Any) -> Any:
    """``loader``'s first batch, drawn with the random state put back afterwards."""
    with torch.random.fork_rng(devices=[]):
        return next(iter(loader))


def first_batch_shape(batch: Any) -> tuple[int, int]:
    """``(batch, sequence)`` of the first integer 2-D tensor (the tokens) in a training batch."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(_tensors(batch))
    tokens = next((t for t in tensors if t.dim() == 2 and not t.is_floating_point()), None)
    if tokens is None:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or "none"
        raise PlanError("layout='auto' plans transformer language models from their token batch (an integer"
                        f" batch x sequence tensor); the first training batch has tensors of shapes {shapes}. Choose"
                        " the sizes yourself (FourDStrategy(dp=..., tp=...)).")
    return int(tokens.shape[0]), int(tokens.shape[1])


def _tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def held_bytes(module: Any, device: torch.device) -> float:
    """What ``module``'s parameters and buffers hold on ``device``'s kind of memory (nothing of a meta-built one)."""
    tensors = [*module.parameters(), *module.buffers()]
    return float(sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type))


def trials_beside(candidates: list[Estimate], trials: int, held: float, budget: float) -> tuple[list[Estimate],
                                                                                               Optional[str]]:
    """The candidates ``layout_trials=trials`` runs, and what rank 0 says of those it leaves out. A trial holds its
    copy beside the module's ``held`` bytes (whole while it is copied, then laid out): the first ``trials``
    candidates are tried in order up to the first that does not fit in ``budget`` beside them (one tried in its
    place could be chosen over a faster prediction never measured); with fewer than two left, none is (the
    prediction chooses)."""
    if trials < 2:
        return [], None
    wanted, tried = candidates[:trials], []
    for est in wanted:
        if held + max(est.memory["total"], held) > budget:
            break
        tried.append(est)
    if len(tried) == len(wanted):
        return tried, None
    left = wanted[len(tried)]
    warning = (f"layout_trials={trials}: {len(wanted) - len(tried)} of the {len(wanted)} predicted fastest not tried."
               f" A trial lays out a copy of the module beside the module as it is held ({_format_bytes(held)} per"
               f" device), and {left.layout} needs {_format_bytes(max(left.memory['total'], held))} beside it, over"
               f" {_format_bytes(budget)}{': the prediction chose' if len(tried) < 2 else ''}. Build the module on"
               " the meta device (trainer.init_module(empty_init=True) in configure_model, or init_from) for trials"
               " in this budget.")
    return (tried if len(tried) >= 2 else []), warning


def default_memory(device: torch.device, ranks_on_node: int) -> float:
    """The device's free memory on GPU; on CPU, the machine's memory shared by its ranks."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks_on_node)


def agreed(values: list[float], device: torch.device, op: Any) -> list[float]:
    """``values`` reduced over every rank with ``op`` (one collective at start-up)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def choose_for(strategy: Any, trainer: Any) -> Choice:
    """The strategy's choice (collective: calibration and two reductions), from its module, its first training
    batch, Lightning's precision and its options (see the module docstring)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_4d import _compat as compat
    from lightning_4d.composition.plans import make_plans
    from lightning_4d.planner.calibration import calibrate
    from lightning_4d.planner.estimate import PRECISIONS

    module, device, world = strategy.lightning_module, strategy.root_device, strategy.world_size
    if any(isinstance(p, torch.distributed.tensor.DTensor) for p in module.parameters()):
        raise PlanError(f"layout='auto' chooses the layout itself, but {type(module).__name__}.configure_model laid"
                        " the module out already (its parameters are DTensors). Remove layout='auto', or the"
                        " parallelization from configure_model.")
    check_trials_possible(module, strategy.layout_trials)
    model = Model.from_module(module)
    first = first_batch(compat.train_dataloader(trainer))
    batch, seq = (int(v) for v in agreed(list(first_batch_shape(first)), device, dist.ReduceOp.MAX))
    budget = strategy.memory_per_device or default_memory(device, strategy.num_processes)
    budget, negated_held = agreed([budget, -held_bytes(module, device)], device, dist.ReduceOp.MIN)
    held = -negated_held  # the most any rank holds
    machine = calibrate(device, strategy.num_processes)
    precision = str(getattr(strategy.precision_plugin, "precision", "32-true"))
    composition = strategy.composition
    training = Training(seq_len=seq, global_batch=batch, precision=precision if precision in PRECISIONS else "32-true",
                        optimizer="adamw", microbatches=strategy.pp_config.microbatches,
                        pp_schedule=strategy.pp_config.schedule,
                        sequence_parallel=strategy.tp_config.sequence_parallel,
                        activation_checkpointing=composition["activation_checkpointing"].mode,
                        activation_checkpointing_every=composition["activation_checkpointing"].every,
                        fuse_lm_loss=composition["fuse_lm_loss"])

    def refused(layout: Layout) -> Optional[str]:
        try:
            make_plans(module, layout_dims(strategy, layout), pipeline=replace(strategy.pp_config, pp=layout.pp),
                       tensor=replace(strategy.tp_config, tp=layout.tp))
        except ValueError as error:
            return str(error).splitlines()[0]
        return None

    choice = choose(model, batch, seq, training, world, fixed_sizes(strategy.requested_sizes), budget, machine,
                    refused)
    tried, warning = trials_beside(choice.candidates, strategy.layout_trials, held, budget)
    if warning:
        rank_zero_warn(warning)
    if tried:  # the slowest rank's time of each, in one reduction
        seconds = time_layouts(strategy, trainer, tried, first)
        choice = choice.tried(tried, agreed(seconds, device, dist.ReduceOp.MAX))
    everyone = [None] * world if dist.is_initialized() else [str(choice.layout)]
    if dist.is_initialized():
        dist.all_gather_object(everyone, str(choice.layout))  # once, at start-up
    if len(set(everyone)) > 1:
        raise RuntimeError(f"layout='auto': the ranks chose different layouts ({sorted(set(everyone))}). Please report"
                           " this; give the sizes (FourDStrategy(dp=..., tp=...)) meanwhile.")
    return choice


def check_auto_layout(layout: Any, memory_per_device: Any, layout_trials: Any = 1) -> tuple[bool, Optional[float], int]:
    """``FourDStrategy(layout=..., memory_per_device=..., layout_trials=...)`` checked at construction:
    ``(automatic, bytes, trials)``."""
    check_layout_trials(layout_trials, layout == "auto")
    automatic, budget = _check_budget(layout, memory_per_device)
    return automatic, budget, layout_trials


def _check_budget(layout: Any, memory_per_device: Any) -> tuple[bool, Optional[float]]:
    if layout not in (None, "auto"):
        raise ValueError(f"layout={layout!r}: use \"auto\" (the strategy chooses dp, dp_shard, pp, cp, tp, activation"
                         " checkpointing and micro-batches by predicted time) or leave it unset and give the sizes.")
    if memory_per_device is None:
        return layout == "auto", None
    if layout != "auto":
        raise ValueError(f"memory_per_device={memory_per_device!r} is the budget layout=\"auto\" chooses within: set"
                         " layout=\"auto\" too, or leave it unset.")
    if isinstance(memory_per_device, str):
        from lightning_4d.planner.cli import parse_bytes

        try:
            memory_per_device = parse_bytes(memory_per_device)
        except Exception as error:  # argparse's type error: the same words, as a ValueError
            raise ValueError(f"memory_per_device={memory_per_device!r}: {error}") from None
    if isinstance(memory_per_device, bool) or not isinstance(memory_per_device, (int, float)) or memory_per_device <= 0:
        raise ValueError(f"memory_per_device={memory_per_device!r} must be a positive size: bytes, or a string such as"
                         " \"80GiB\".")
    return True, float(memory_per_device)


def adopt(strategy: Any, choice: Choice) -> None:
    """The strategy takes the chosen sizes: its requested sizes, resolved dims, typed configs and the options
    ``parallelize`` receives, as if the user had given them; rank 0 describes the choice, and the layout is refused
    for this module as a user's would be, before any process group of it is built."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_4d.composition.options import check_layout
    from lightning_4d.parallel_dims import ParallelDims

    layout = choice.layout
    strategy.requested_sizes.update(dp=layout.dp, dp_shard=layout.dp_shard, pp=layout.pp, cp=layout.cp, tp=layout.tp)
    strategy.parallel_dims = ParallelDims.resolve(strategy.world_size, **strategy.requested_sizes)
    strategy.composition.update(layout_options(strategy, choice.estimate))
    strategy.cp_config, strategy.pp_config, strategy.tp_config = map(strategy.composition.get,
                                                                     ("context", "pipeline", "tensor"))
    if strategy.global_rank == 0:
        rank_zero_info(choice.describe())
    check_layout(strategy, user_parallelized=False)
