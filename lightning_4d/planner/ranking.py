"""Ranking the layouts of a world: every valid layout estimated (:mod:`.estimate`), judged against a memory
budget, timed on a machine (:mod:`.step_time`) where one is given, and sorted; and the messages that say what
to change when nothing is valid or nothing fits."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from lightning_4d.planner.estimate import (BUILDS, Estimate, Layout, Training, _format_bytes, all_layouts, estimate,
                                           layout_problems)
from lightning_4d.planner.model_sizes import Model, PlanError


def plan(model: Model, training: Training, devices: int, memory_per_device: Optional[float] = None,
         include_unfit: bool = False, build: str = "whole", machine: Optional[Any] = None) -> list[Estimate]:
    """Valid layouts ranked by predicted step time on ``machine`` (a :class:`.step_time.Machine`; without one,
    by communication per step), then memory, fitting ones first. A layout fits when its training peak and the
    setup peak of ``build`` (``"whole"`` or ``"meta"``) both fit: a run that cannot build its model does not start.

    With a machine, activation checkpointing (when ``training`` leaves it ``"none"``) and the pipeline's
    micro-batch count (when it leaves it unset) are part of a layout: each layout comes with the fastest
    predicted of those that fit (:attr:`Estimate.training`), so checkpointing is chosen only where memory needs it.

    Raises :class:`PlanError` when no layout of ``devices`` is valid, or none fits ``memory_per_device``
    and ``include_unfit`` is false."""
    if memory_per_device is not None and memory_per_device <= 0:
        raise PlanError(f"memory per device ({memory_per_device!r}) must be positive.")
    if build not in BUILDS:
        raise PlanError(f"build={build!r} is not one of {', '.join(BUILDS)}: 'whole' when every rank builds the whole"
                        " model, 'meta' when it is built on the meta device (trainer.init_module(empty_init=True))"
                        " or loaded with init_from.")
    candidates = all_layouts(devices)
    options = {layout: runnable_variants(model, training, layout, explore=machine is not None)
               for layout in candidates}
    valid = [layout for layout in candidates if options[layout]]
    if not valid:
        rejected = {layout: layout_problems(model, training, layout) for layout in candidates}
        raise PlanError(_no_valid_layout_message(model, training, devices, rejected))
    estimates = []
    for layout in valid:
        judged = [_judged(model, variant, layout, build, memory_per_device, machine) for variant in options[layout]]
        estimates.append(min(judged, key=_rank))
    if memory_per_device is not None:
        if not include_unfit and not any(est.fits for est in estimates):
            raise PlanError(_no_fit_message(estimates, memory_per_device, training))
        if not include_unfit:
            estimates = [est for est in estimates if est.fits]
    estimates.sort(key=_rank)
    return estimates


def _variants(training: Training, layout: Layout, explore: bool) -> list[Training]:
    """``training`` and, when exploring, its activation checkpointing modes and micro-batch counts the user left
    open (the default count first)."""
    if not explore:
        return [training]
    modes = ["none", "selective", "full"] if training.activation_checkpointing == "none" else \
        [training.activation_checkpointing]
    counts = [None, layout.pp, 4 * layout.pp] if layout.pp > 1 and training.microbatches is None else \
        [training.microbatches]
    return [replace(training, activation_checkpointing=mode, microbatches=count) for mode in modes for count in counts]


def runnable_variants(model: Model, training: Training, layout: Layout, explore: bool) -> list[Training]:
    """The variants of ``training`` (:func:`_variants`) that ``layout`` can run: a pipeline whose default
    ``2 * pp`` micro-batches do not divide a small batch may still run ``pp`` of them."""
    return [variant for variant in _variants(training, layout, explore) if not layout_problems(model, variant, layout)]


def _judged(model: Model, training: Training, layout: Layout, build: str, memory_per_device: Optional[float],
            machine: Optional[Any]) -> Estimate:
    est = estimate(model, training, layout)
    est.build, est.training = build, training
    if machine is not None and machine.runtime_bytes:  # what the runtime holds beside the tensors, measured
        est.memory["runtime"] = machine.runtime_bytes
        est.memory["total"] += machine.runtime_bytes
    if memory_per_device is not None:
        est.exceeds = tuple(name for name, peak in (("training", est.memory["total"]), ("setup", est.setup_peak))
                            if peak > memory_per_device)
        est.fits = not est.exceeds
    if machine is not None:
        est.step = machine.predict(model, training, layout)
    return est


def _rank(est: Estimate) -> tuple:
    return est.fits is False, est.step.total if est.step else est.comm["total"], est.memory["total"]


def _no_valid_layout_message(model: Model, training: Training, devices: int,
                             rejected: dict[Layout, list[str]]) -> str:
    lines = [f"no layout of {devices} devices can run this model and batch:"]
    for layout, problems in list(rejected.items())[:8]:
        lines.append(f"  {layout}: {'; '.join(problems)}")
    if len(rejected) > 8:
        lines.append(f"  ... and {len(rejected) - 8} more layouts")
    near = [d for d in range(1, 2 * devices + 1) if d != devices and any(
        not layout_problems(model, training, layout) for layout in all_layouts(d))]
    nearest = sorted(near, key=lambda d: (abs(d - devices), d))[:3]
    lines.append(f"Change the number of devices (nearest that work: {', '.join(map(str, sorted(nearest)))}), the"
                 " global batch (a multiple of more dp sizes), or the sequence length (a multiple of 2*cp).")
    return "\n".join(lines)


def _no_fit_message(estimates: list[Estimate], memory_per_device: float, training: Training) -> str:
    trained = [est for est in estimates if est.memory["total"] <= memory_per_device]
    if trained:  # training fits somewhere; building the model does not
        best = min(trained, key=lambda est: est.setup_peak)
        text = (f"no layout fits in {_format_bytes(memory_per_device)} per device: {len(trained)} fit training, but"
                f" building the model needs at least {_format_bytes(best.setup_peak)} per device ({best.layout},"
                f" --build {best.build}).")
        if best.build == "whole" and best.setup["meta"] <= memory_per_device:
            text += (f" Build it on the meta device (trainer.init_module(empty_init=True) in configure_model, or"
                     f" init_from) and plan with --build meta ({_format_bytes(best.setup['meta'])}).")
        else:
            text += " Use more devices, or devices with more memory."
        return text
    best = min(estimates, key=lambda est: est.memory["total"])
    state = best.memory["params"] + best.memory["grads"] + best.memory["optimizer"]
    hints = ["more devices", "devices with more memory"]
    if best.memory["activations"] > 0.2 * best.memory["total"]:
        hints.insert(0, "a shorter sequence or smaller global batch (activations"
                        f" {_format_bytes(best.memory['activations'])})")
    if training.precision == "32-true":
        hints.append("precision bf16-true (half the model state)")
    runtime = best.memory.get("runtime", 0.0)
    copies = best.memory["total"] - state - best.memory["activations"] - runtime
    parts = f"model state {_format_bytes(state)}, activations {_format_bytes(best.memory['activations'])}"
    if copies > 0:
        parts += f", gradient copies {_format_bytes(copies)}"
    if runtime:
        parts += f", the runtime {_format_bytes(runtime)} (measured)"
    return (f"no layout fits in {_format_bytes(memory_per_device)} per device: the smallest estimate is"
            f" {_format_bytes(best.memory['total'])} ({best.layout}: {parts}). Use {', or '.join(hints)}.")
