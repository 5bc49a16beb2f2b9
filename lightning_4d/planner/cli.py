"""``python -m lightning_4d.plan``: the planner's command line (argument parsing, one-line failures, the table).

Imports nothing heavy before the arguments are parsed, so ``--help`` answers at once; ``--module`` builds the
class on the meta device only when asked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional

from lightning_4d._cli import CLASS_SYNTAX, fail
from lightning_4d.planner.estimate import (
    AC_MODES,
    BUILDS,
    OPTIMIZER_STATES,
    PP_SCHEDULES,
    PRECISIONS,
    Estimate,
    Model,
    PlanError,
    Training,
    _format_bytes,
    _microbatches,
    choose_cp_comm,
    cp_exchanges,
)
from lightning_4d.planner.ranking import plan

_UNITS = {"": 2**30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def format_table(estimates: Sequence[Estimate]) -> str:
    """The ranked layouts as an aligned text table: memory parts, the setup peak of the chosen build, bytes sent
    per dim, and whether it fits ("no: setup" when training would fit but building the model does not)."""
    timed = any(est.step for est in estimates)
    header = ["#", "dp", "dp_shard", "pp", "cp", "tp", *(["ac", "m", "step (s)"] if timed else []), "state", "activations", "logits",
              "pp grads", "buckets", "gathered", "memory", "setup", "comm/step", "dp", "dp_shard", "tp", "cp", "pp",
              "fits"]
    rows = []
    for rank, est in enumerate(estimates, 1):
        mem, comm = est.memory, est.comm
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        fits = {None: "", True: "yes", False: "no"}[est.fits]
        if est.exceeds == ("setup",):
            fits = "no: setup"  # training would fit; building the model does not
        rows.append([str(rank), *(str(getattr(est.layout, d)) for d in ("dp", "dp_shard", "pp", "cp", "tp")),
                     *([est.training.activation_checkpointing, str(_microbatches(est.training, est.layout)),
                        f"{est.step.total:.3g}"] if timed else []),
                     *(_format_bytes(value) for value in (state, mem["activations"], mem["logits"],
                                                          mem["pipeline_grads"],
                                                          mem["grad_buckets"], mem["gathered"], mem["total"],
                                                          est.setup_peak, comm["total"])),
                     *(_format_bytes(comm[d]) for d in ("dp", "dp_shard", "tp", "cp", "pp")), fits])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def why_first(estimates: Sequence[Estimate]) -> str:
    """Why the first layout leads: its predicted parts, and what makes the runner-up slower."""
    first = estimates[0]
    parts = ", ".join(f"{name} {value:.3g}" for name, value in first.step.parts.items()
                      if name != "total" and value > 0.005 * first.step.total)
    text = f"first: {first.layout}, predicted {first.step.total:.3g} s per step ({parts})"
    if first.step.shared_cores:
        text += "; its ranks share the cores, so the step is their work spread over them"
    if len(estimates) > 1 and estimates[1].step is not None:
        second = estimates[1]
        slower = second.step.total / first.step.total - 1
        worse = max((name for name in second.step.parts if name != "total"),
                    key=lambda name: second.step.parts[name] - first.step.parts.get(name, 0.0))
        text += (f". Next: {second.layout}, {slower:.0%} slower, mostly {worse}"
                 f" ({second.step.parts[worse]:.3g} s against {first.step.parts.get(worse, 0.0):.3g} s).")
    return text


def machine_from_args(args: argparse.Namespace) -> Any:
    """The machine predictions are for: measured here (``--measure``), a preset or a calibration file
    (``--machine``), or None (ranked by bytes sent)."""
    from lightning_4d.planner.calibration import PRESETS, measure_here
    from lightning_4d.planner.step_time import Machine

    if args.measure:
        if args.devices > 16:
            raise PlanError(f"--measure starts --devices ({args.devices}) processes on this machine: measure with"
                            " the devices one machine of the target has (--devices 8 on an 8-GPU node), or give"
                            f" --machine ({', '.join(PRESETS)}, or a calibration JSON file).")
        return measure_here(args.devices)
    if args.machine is None:
        return None
    if args.machine in PRESETS:
        return PRESETS[args.machine]
    try:
        return Machine.from_dict(json.loads(open(args.machine).read()))
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise PlanError(f"--machine {args.machine!r} is neither a preset ({', '.join(PRESETS)}) nor a readable"
                        f" calibration file ({type(error).__name__}: {error}).") from None


def build_module(spec: str, init_args: dict[str, Any]) -> Any:
    """Instantiate ``package.module:Class`` (or ``package.module.Class``) on the meta device."""
    import torch

    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise PlanError(f"--module {spec!r} is not importable ({error}): write package.module:ClassName.") from None
    with torch.device("meta"):
        module = cls(**init_args)
        if hasattr(module, "configure_model"):
            module.configure_model()
    return module


def parse_bytes(text: str) -> float:
    """``80GiB``, ``80GB`` (1e9), ``512MiB``; a bare number is GiB."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: write e.g. 80GiB, 80GB or 512MiB.")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def _parse_count(text: str) -> int:
    """``7e9``, ``124M``, ``1.3B``, ``1_000``."""
    match = re.fullmatch(r"\s*([0-9._]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count: write e.g. 124M, 7B or 7e9.")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    return int(float(match.group(1).replace("_", "")) * scale)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_4d.plan",
        description="Rank the (dp, pp, cp, tp) layouts of a model on N devices by predicted step time (with"
                    " --measure or --machine; else by communication per step), with memory per device.")
    parser.add_argument("--devices", type=int, required=True, help="number of devices (world size)")
    parser.add_argument("--memory", type=parse_bytes, help="memory per device: 80GiB, 80GB, 24GiB (bare: GiB)")
    model = parser.add_argument_group("model: a LightningModule class, or sizes")
    model.add_argument("--module", help=f"{CLASS_SYNTAX}, built on the meta device to read its sizes")
    model.add_argument("--init-args", type=json.loads, default={}, help="JSON keyword arguments for --module")
    model.add_argument("--params", type=_parse_count, help="total parameters (7B, 124M, 7e9)")
    model.add_argument("--layers", type=int)
    model.add_argument("--hidden", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention); default: heads")
    model.add_argument("--ffn-hidden", type=int, help="MLP inner size; default 4*hidden")
    model.add_argument("--vocab", type=int)
    model.add_argument("--tied", action="store_true", help="the head shares the embedding's weight")
    model.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (gate, up and down projections)")
    moe = parser.add_argument_group("mixture of experts (ranks ep layouts too; read from --module when it has them)")
    moe.add_argument("--experts", type=int, help="routed experts per MoE layer (with sizes: every layer is MoE)")
    moe.add_argument("--expert-ffn", type=int, help="each expert's intermediate size; default: --ffn-hidden")
    moe.add_argument("--top-k", type=int, help="experts each token goes to (default 2; --module: its own)")
    moe.add_argument("--ep", type=int, action="append",
                     help="expert-parallel size to consider (repeatable); default: every ep that fits")
    train = parser.add_argument_group("training")
    train.add_argument("--seq", type=int, required=True, help="sequence length")
    train.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step, all replicas")
    train.add_argument("--precision", default="32-true", choices=list(PRECISIONS))
    train.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES))
    train.add_argument("--microbatches", type=int, help="pipeline micro-batches per step (default: 2*pp)")
    train.add_argument("--synced-logs", type=int, default=1,
                       help="values the step logs with sync_dist=True (default 1, the loss), for the step time")
    train.add_argument("--pp-schedule", default="1f1b", choices=list(PP_SCHEDULES))
    train.add_argument("--sequence-parallel", action="store_true")
    train.add_argument("--no-fused-attention", dest="fused_attention", action="store_false",
                       help="attention materializes its s*s scores (no flash/memory-efficient kernel)")
    train.add_argument("--fused-norm", action="store_true",
                       help="the norms are single kernels (nn.LayerNorm) that keep no normalized copy")
    train.add_argument("--dropout", action="store_true")
    train.add_argument("--activation-checkpointing", default="none", choices=list(AC_MODES),
                       help="as FourDStrategy(activation_checkpointing=...): what each block keeps for backward")
    train.add_argument("--activation-checkpointing-every", type=int, default=2, help="the n of every_n")
    train.add_argument("--no-fuse-lm-loss", dest="fuse_lm_loss", action="store_false",
                       help="as FourDStrategy(fuse_lm_loss=False): the LM head's logits exist whole")
    train.add_argument("--build", default="whole", choices=list(BUILDS),
                       help="how the model is built, for the setup peak: whole on every rank (default), or on the"
                            " meta device (trainer.init_module(empty_init=True), init_from)")
    machine = parser.add_argument_group("step time (ranks by predicted time; without these, by bytes sent)")
    machine.add_argument("--measure", action="store_true",
                         help="calibrate on this machine with --devices processes (seconds; cached per machine)")
    machine.add_argument("--machine", help="a preset (h100) or a calibration JSON file")
    trials = parser.add_argument_group(
        "trials: FourDStrategy(layout=\"auto\", layout_trials=k) on --devices processes here")
    trials.add_argument("--trials", type=int,
                        help="the k layouts predicted fastest each run a few steps of --module here (built for real:"
                             " it trains); predicted and measured side by side")
    trials.add_argument("--data", help=f"{CLASS_SYNTAX}: the LightningDataModule the trials read --module's first"
                                       " batch from (default: (input_ids, labels) pairs of random tokens, a loader"
                                       " batch of --global-batch / --devices per replica)")
    trials.add_argument("--data-args", type=json.loads, default={}, help="JSON keyword arguments for --data")
    out = parser.add_argument_group("output")
    out.add_argument("--all", action="store_true", help="also list valid layouts that do not fit")
    out.add_argument("--top", type=int, help="print only the best N")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def check_trials(args: argparse.Namespace, runnable: bool) -> None:
    """``--trials`` refused before anything starts when it cannot run here."""
    if args.trials is None:
        return
    if not runnable:
        raise PlanError("--trials sets FourDStrategy up: run it as python -m lightning_4d.plan.")
    if args.trials < 1:
        raise PlanError(f"--trials {args.trials}: give the number of layouts to run, 1 or more.")
    if args.module is None:
        raise PlanError("--trials trains the model: give it as --module package.module:Class (with --init-args), e.g."
                        " --module lightning_4d.demos.gpt:GPT for the example GPT.")
    if args.json:
        raise PlanError("--trials prints the strategy's description of its trials, which is text: drop --json.")
    if args.devices > 16:
        raise PlanError(f"--trials starts --devices ({args.devices}) processes on this machine: run them on a"
                        " machine of the target with the devices it has (--devices 8 on an 8-GPU node).")
    if args.data is None and args.global_batch % args.devices:
        raise PlanError(f"--trials feeds each replica a loader batch of --global-batch / --devices, and"
                        f" {args.global_batch} samples do not split over {args.devices} devices: change"
                        " --global-batch, or give --data.")


def run_trials(args: argparse.Namespace, model: Model, strategy: str) -> dict[str, int]:
    """``--trials k``: the ``strategy`` class (``package.module:Class``) with ``layout="auto", layout_trials=k``
    set up on ``--devices`` processes of this machine for --module (built here, not on the meta device: it trains)
    and no training step, so the choice and its trials are the strategy's own (rank 0 prints the candidates,
    predicted and measured). The first batch comes from --data, else from ``(input_ids, labels)`` pairs of random
    tokens. CPU ranks are forked from this process, which stays rank 0; GPUs start theirs as Lightning does.
    Returns the sizes chosen."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d._cli import import_class

    module = import_class(args.module)(**args.init_args)
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= args.devices
    chosen = import_class(strategy, "strategy")(layout="auto", layout_trials=args.trials,
                                                memory_per_device=args.memory,
                                                start_method="popen" if on_gpu else "fork")
    trainer = pl.Trainer(accelerator="cuda" if on_gpu else "cpu", devices=args.devices, strategy=chosen,
                         precision=args.precision, max_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if args.data:
        trainer.fit(module, datamodule=import_class(args.data, "--data")(**args.data_args))
    else:
        tokens = torch.randint(0, model.vocab, (args.global_batch, args.seq + 1),
                               generator=torch.Generator().manual_seed(0))
        trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                                       batch_size=args.global_batch // args.devices))
    return {name: chosen.requested_sizes[name] for name in ("dp", "dp_shard", "pp", "cp", "tp")}


def _model_from_args(args: argparse.Namespace) -> Model:
    sizes = {name: getattr(args, name) for name in ("layers", "hidden", "heads")}
    if args.module:
        return Model.from_module(build_module(args.module, args.init_args))
    missing = [f"--{name}" for name, value in sizes.items() if value is None]
    if missing:
        raise PlanError(f"describe the model with --module package.module:Class, or with sizes: missing"
                        f" {' '.join(missing)}.")
    return Model.from_sizes(**sizes, vocab=args.vocab, ffn_hidden=args.ffn_hidden, kv_heads=args.kv_heads,
                            tied=args.tied, params=args.params, gated_mlp=args.gated_mlp)


def _moe_from_args(args: argparse.Namespace, model: Model) -> Any:
    """The model's MoE sizes, or None when neither --experts, --ep nor an MoE --module asks for ep layouts."""
    from lightning_4d.planner.experts import MoESizes, sizes_from_args

    if args.module:
        try:
            return MoESizes.from_module(build_module(args.module, args.init_args), top_k=args.top_k)
        except PlanError:
            if args.ep or args.experts:
                raise
            return None
    if args.experts is None:
        if args.ep:
            raise PlanError("--ep needs the experts: pass --experts N (and --expert-ffn, --top-k), or an MoE --module.")
        return None
    return sizes_from_args(model.layers, model.hidden, args.experts, args.expert_ffn or model.ffn_hidden,
                           args.top_k or 2, model.params)


def format_expert_table(rows: Sequence[dict[str, Any]]) -> str:
    """The ranked (layout, ep) pairs: expert and other parameters per rank, model state, expert-parallel traffic per step."""
    header = ["#", "dp", "dp_shard", "pp", "cp", "tp", "ep", "expert params", "other params", "state",
              "ep traffic/step"]
    lines = []
    for rank, row in enumerate(rows, 1):
        layout = row["layout"]
        lines.append([str(rank), *(str(getattr(layout, d)) for d in ("dp", "dp_shard", "pp", "cp", "tp")),
                      str(row["ep"]), f"{row['expert_params'] / 1e6:,.2f}M", f"{row['dense_params'] / 1e6:,.2f}M",
                      _format_bytes(row["model_state_bytes"]), _format_bytes(row["ep_bytes"])])
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None, strategy: Optional[str] = None) -> int:
    """Run the planner's command line; returns the exit status. ``strategy``: the class ``--trials`` sets up, as
    ``package.module:Class`` (``python -m lightning_4d.plan`` names FourDStrategy: the planner does not import it,
    the strategy imports the planner; and ``--help`` imports neither torch nor Lightning)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        try:
            model = _model_from_args(args)
        except PlanError:
            raise
        except Exception as error:  # the user's constructor (--module): any failure is reported in one line
            if not args.module:
                raise
            raise PlanError(f"--module {args.module} with --init-args {json.dumps(args.init_args)} failed:"
                            f" {type(error).__name__}: {error}") from None
        training = Training(seq_len=args.seq, global_batch=args.global_batch, precision=args.precision,
                            optimizer=args.optimizer, microbatches=args.microbatches,
                            pp_schedule=args.pp_schedule, sequence_parallel=args.sequence_parallel,
                            fused_attention=args.fused_attention, fused_norm=args.fused_norm, dropout=args.dropout,
                            activation_checkpointing=args.activation_checkpointing,
                            activation_checkpointing_every=args.activation_checkpointing_every,
                            fuse_lm_loss=args.fuse_lm_loss, synced_logs=args.synced_logs)
        check_trials(args, strategy is not None)
        machine = machine_from_args(args)
        estimates = plan(model, training, args.devices, args.memory, include_unfit=args.all, build=args.build,
                         machine=machine)
        moe = _moe_from_args(args, model)
        experts = None
        if moe is not None:
            from lightning_4d.planner.experts import rank_expert_layouts

            experts = rank_expert_layouts(moe, [est.layout for est in estimates], args.seq, args.global_batch,
                                          args.precision, args.optimizer, args.ep)
    except PlanError as error:
        fail(parser, error)
    if args.top:
        estimates = estimates[:args.top]
    if args.json:
        print(json.dumps({"model": asdict(model), "params": model.params, "training": asdict(training),
                          "devices": args.devices, "memory_per_device": args.memory, "build": args.build,
                          "layouts": [est.as_dict() for est in estimates],
                          **({"moe": asdict(moe), "expert_layouts": [
                              {**row, "layout": asdict(row["layout"])} for row in experts[:args.top or None]]}
                             if experts is not None else {})}, indent=2))
        return 0
    print(f"model: {model.params / 1e6:,.1f}M parameters, {model.layers} layers, hidden {model.hidden}, heads"
          f" {model.heads} (kv {model.kv_heads}), ffn {model.ffn_hidden}{' gated' if model.gated_mlp else ''},"
          f" vocab {model.vocab}"
          f"{' (tied)' if model.tied else ''}")
    print(f"step: global batch {training.global_batch} x sequence {training.seq_len}, {training.precision},"
          f" {training.optimizer}{', sequence parallel' if training.sequence_parallel else ''}")
    print(f"{args.devices} devices" + (f", {_format_bytes(args.memory)} each" if args.memory else "")
          + "; memory = state + gathered + max(activations + logits + pp grads, buckets); setup = peak while the"
            " model is"
            f" built ({args.build}); comm = bytes sent per device per step\n")
    if machine is not None:
        runtime = (f"; memory includes the {_format_bytes(machine.runtime_bytes)} per device its runtime took"
                   " beside the tensors" if machine.runtime_bytes else "")
        print(f"step time predicted for {machine.source}{runtime}\n")
    print(format_table(estimates))
    if machine is not None:
        print("\n" + why_first(estimates))
    if experts is not None:
        print(f"\nexpert parallelism: {moe.layers} MoE layers of {moe.experts} experts (hidden {moe.hidden}, inner"
              f" {moe.inner}, top-{moe.top_k}), {moe.expert_params / 1e6:,.1f}M expert parameters; per rank, ranked"
              " by model state (experts over ep x tp, the rest over tp x dp_shard), then expert-parallel bytes sent"
              " per step (balanced routing where the experts are exchanged all-to-all):")
        print(format_expert_table(experts[:args.top or None]))
    with_cp = [est for est in estimates if est.layout.cp > 1]
    if with_cp:
        print("\ncontext-parallel exchange (bytes one device sends per attention layer and micro-batch, forward and"
              " backward; the comm/step column counts the chosen one):")
        for est in with_cp[:5]:
            exchanges = cp_exchanges(model, training, est.layout)
            ways = ", ".join(f"{name} {_format_bytes(cost)}" for name, cost in exchanges.items())
            missing = "" if "a2a" in exchanges else f"; a2a: cp={est.layout.cp} does not divide the heads per tp rank"
            print(f"  {est.layout}: cp_comm={choose_cp_comm(model, training, est.layout)!r} ({ways}{missing})")
    if args.trials:
        batch = (f"a loader batch of {args.global_batch // args.devices} per replica" if args.data is None
                 else f"{args.data}'s batches")
        print(f"\ntrials: FourDStrategy(layout=\"auto\", layout_trials={args.trials}) on {args.devices} processes"
              f" here, {batch}; it ranks per sample (a layout with more replicas trains more samples per step) and"
              " prints its candidates, predicted and measured:", flush=True)
        try:
            chosen = run_trials(args, model, strategy)
        except Exception as error:  # noqa: BLE001  the user's module, data or a refused layout: one line
            fail(parser, f"--trials failed: {type(error).__name__}: {error}")
        print("chosen by the trials: " + " ".join(f"{name}={size}" for name, size in chosen.items()))
    return 0
