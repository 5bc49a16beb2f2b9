"""What a rank's step computes on its shard, checked against the whole sequence before any weight changes.

Context parallelism makes attention, position modules, the masks it can read, token-mean losses and logged
means global. Code that depends on where a token sits or on the length it sees (``logits[:, -16:]``,
``torch.arange(x.size(1))`` in a weight or a mask, a prompt mask or position ids built in the step or in
forward, a random mask drawn in the shard's shape) computes something else on a shard, and would train another
model than one process without a word. So on the first training, validation and test batch every rank runs the
step on a sample of its batch twice, without gradients, in eval mode and without autocast: **sharded** as
training runs it (ring attention, global positions, token losses and logged values combined over the cp group)
and **whole**, with context parallelism off, as one process would. It compares the returned loss and every
logged value:

* a difference beyond round-off stops every rank before the step, naming the step, the values, the usual causes
  and fixes that work (:class:`StepMismatch`);
* a step that fails on the shard but runs whole is refused with the same explanation before its own error;
* a logged value that matches one process when taken once rather than combined with its ``reduce_fx`` (a
  sample count summed over cp) or when summed (a token count) is combined that way from then on, said once.

The sample is the batch with every sequence cut to ``check_tokens`` tokens (a multiple of ``2 x cp``, and of
``tp`` under sequence parallelism). The runs leave no trace: logged values go nowhere, torchmetrics states,
module modes and every random stream are restored, optimizer and scheduler steps and ``manual_backward`` do
nothing while they run. It costs two forward passes of the sample once per step method, and one object
all-gather over the cp group and one over the world, outside the steady state.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_4d import _compat as compat
from lightning_4d.context_parallel.apply import MODEL_REFUSAL, ContextParallel
from lightning_4d.context_parallel.batches import _map_tensors, sequence_paths
from lightning_4d.numerics.step_logging import StepLogs, _reduce_name

STEPS = ("training_step", "validation_step", "test_step")
# Relative and absolute tolerance of a comparison. The check computes in full fp32 (no autocast, no TF32), where
# the round-off of ring against whole-sequence attention measured at most 2.3e-7 relative on a loss over the
# suite's cp models; the differences the check exists for were 1.7e-2 to 3e-2 on the first models measured and
# 2.5e-4 for a last-4-token loss of an untrained tiny model. With 16-bit parameters (or FSDP computing in 16
# bits) round-off is ~1e-2 itself: the check then finds only larger differences.
TOLERANCE = {"fp32": (1e-5, 1e-6), "16-bit": (5e-2, 1e-3)}
_LEARNABLE = ("one", "sum")  # other combinations the check may learn for a logged value, in this order

CAUSES = ("slicing or indexing the sequence dim (logits[:, -16:], the first or last tokens; one token tensor"
          " shifted in the step, model(x[:, :-1]) against x[:, 1:]); torch.arange(x.size(1)) or x.size(1) in a"
          " weight, a mask or position ids, in the step or in the model's forward; masks, labels or position ids"
          " derived from the tokens a rank sees; random masks drawn in the shape of the rank's tokens")
FIXES = ("build them in the data, where context parallelism shards them with the tokens: inputs and labels already"
         " shifted (input_ids = tokens[:-1], labels = tokens[1:] per sample), prompt and response masks as labels"
         " of -100, attention_mask and position_ids as batch entries; or compute them from"
         " lightning_4d.sequence_positions(x), the global positions and length of the tokens this rank holds"
         " (docs/context_parallel.md, \"What your step sees under cp\")")


class StepMismatch(ValueError):
    """The step computes on its shard of the sequence something other than one process on the whole."""


@dataclass
class _Seen:
    """What one run of the step gave: its loss and logged values, as floats (NaN kept), and its error."""

    loss: Optional[list[float]] = None
    # name -> (kind: "value" or "metric", its values, its reduce_fx, whether it is logged per step)
    logs: dict[str, tuple[str, Optional[list[float]], str, bool]] = field(default_factory=dict)
    error: Optional[BaseException] = None
    # every module call, in the order calls ended: (name, class, its inputs' and its outputs' summaries)
    calls: list[tuple[str, str, list, list]] = field(default_factory=list)


class StepCheck:
    """Checks each of ``training_step``, ``validation_step`` and ``test_step`` once, on its first batch.

    ``run(sample, sharded)``, given to :meth:`check`, runs the step on ``sample`` and returns what training
    returns: sharded, inside the context's :meth:`~ContextParallel.context`, with token losses and the loss
    combined over the cp group; whole, as one process. The check runs it without gradients.
    """

    def __init__(self, context: ContextParallel, module: nn.Module, device: torch.device, tokens: int,
                 low_precision: bool) -> None:
        self.context, self.module, self.device, self.tokens = context, module, device, tokens
        self.tolerance = TOLERANCE["16-bit" if low_precision else "fp32"]
        self.pending = set(STEPS)

    def due(self, name: Optional[str]) -> bool:
        """The next step of ``name`` is checked (its batch must be kept whole when sharded)."""
        return name in self.pending

    def check(self, name: str, run: Callable[[Any, bool], Any]) -> None:
        """Check the step ``name`` on the batch the context kept whole; raise on every rank on a difference.
        Collective over the world."""
        self.pending.discard(name)
        batch, self.context.whole_batch = self.context.whole_batch, None
        if batch is None:
            return
        sample, length = self._sample(batch)
        context = self.context
        positions = context.local_positions(sample, self.device)
        whole = self._observe(name, lambda: run(sample, False), _Summaries(context.seq_dim, length, positions))
        with context.probing(sample) as shard:
            context.agreeing, context.failure_told = True, False
            try:
                sharded = self._observe(name, lambda: run(shard, True), _Summaries(context.seq_dim))
            finally:
                context.agreeing = False
            if not context.failure_told:  # the last word, or the notice of a failure outside attention
                context.agree(sharded.error is not None)
        shards: list[Any] = [None] * self.context.size
        dist.all_gather_object(shards, None if sharded.error else sharded.logs, group=self.context.group)
        reports: list[Any] = [None] * dist.get_world_size()
        ends = [int(positions[0]) == 0, int(positions[-1]) == length - 1]  # the step check's batch only
        dist.all_gather_object(reports, {**self._report(whole, sharded, shards), "ends": ends})
        self._decide(name, reports, sharded, length)

    def _sample(self, batch: Any) -> tuple[Any, int]:
        """``batch`` with every sequence cut to at most ``tokens`` tokens, a length the zigzag split divides."""
        paths, length = sequence_paths(batch, self.context.seq_dim, self.context.batch_keys)
        if self.context.document_key is not None:
            paths.append(self.context.document_key)
        multiple = 2 * self.context.size * self.context.sequence_parallel
        keep = length if length <= self.tokens else max(multiple, self.tokens // multiple * multiple)
        if keep == length:
            return batch, length
        selected, dim = set(paths), self.context.seq_dim
        return _map_tensors(batch, lambda path, t: t.narrow(dim, 0, keep) if path in selected else t), keep

    def _observe(self, name: str, run: Callable[[], Any], summaries: "_Summaries") -> _Seen:
        """One run of the step, leaving no trace; its loss and logged values as floats, or its error; and a
        summary of every module call's inputs and outputs."""
        seen = _Seen()
        logs = StepLogs(self.module)
        hooks = [module.register_forward_hook(summaries.recorder(seen.calls, fqn), with_kwargs=True)
                 for fqn, module in self.module.named_modules()]
        try:
            with _without_trace(self.module, self.device):
                with logs.recording():
                    try:
                        output = run()
                    finally:
                        for hook in hooks:
                            hook.remove()
                loss = output.get("loss") if isinstance(output, Mapping) else output
                if name == "training_step" and isinstance(loss, Tensor):
                    seen.loss = _floats(loss)
                for key, (value, kwargs) in logs.records[0].items():
                    on_step = kwargs.get("on_step")
                    on_step = name == "training_step" if on_step is None else bool(on_step)
                    if isinstance(value, Tensor):
                        seen.logs[key] = ("value", _floats(value), _reduce_name(kwargs), on_step)
                    else:  # a torchmetrics Metric: its value on this batch (forward's), read before it is restored
                        cache = compat.metric_forward_cache(value)
                        values = _floats(cache) if isinstance(cache, Tensor) else None
                        seen.logs[key] = ("metric", values, "mean", on_step)
        except Exception as error:  # noqa: BLE001  judged with every rank's outcome in _decide
            seen.error = error
        return seen

    # ------------------------------------------------------------------------------------------ judging

    def _close(self, got: Optional[list[float]], expected: Optional[list[float]]) -> bool:
        if got is None or expected is None:
            return got is expected
        rtol, atol = self.tolerance
        return len(got) == len(expected) and all(
            (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rtol * abs(b) + atol for a, b in zip(got, expected))

    def _report(self, whole: _Seen, sharded: _Seen, shards: list[Any]) -> dict[str, Any]:
        """This rank's verdict: the errors, the differences (as lines of the message), the first module whose
        output on the shard differs from the whole run's at the same tokens, and, per logged value, the
        combinations over the cp ranks that give one process's value."""
        report: dict[str, Any] = {"rank": dist.get_rank(), "whole_error": _describe(whole.error),
                                  "sharded_error": _describe(sharded.error), "differences": [], "combinations": {},
                                  "fx": {}, "peer": _from_peer(sharded.error), "cp_rank": self.context.rank,
                                  "module": None}
        if whole.error is not None or sharded.error is not None:
            return report
        report["module"] = _first_different_module(whole.calls, sharded.calls)
        differences = report["differences"]
        if not self._close(sharded.loss, whole.loss):
            differences.append(f"the returned loss: {_show(whole.loss)} whole, {_show(sharded.loss)} sharded")
        for key in dict.fromkeys([*whole.logs, *sharded.logs]):
            if key not in whole.logs or key not in sharded.logs:
                where = "on the shard only" if key in sharded.logs else "on the whole sequence only"
                differences.append(f"{key!r} is logged {where}")
                continue
            kind, expected, fx, on_step = whole.logs[key]
            values = [rank_logs[key][1] for rank_logs in shards if rank_logs is not None and key in rank_logs]
            if kind == "metric":
                if on_step and not all(self._close(v, expected) for v in values):
                    differences.append(
                        f"{key!r}, a torchmetrics metric logged per step: {_show(expected)} whole, on the shards"
                        f" {', '.join(_show(v) for v in values)}. Its step value is computed from the tokens this"
                        " rank holds; log it with on_step=False, on_epoch=True (its epoch value is synchronized"
                        " over the data- and context-parallel ranks, and exact)")
                continue
            fits = [combination for combination in (fx, *_LEARNABLE)
                    if self._close(_combine(combination, values, sharded.logs[key][1]), expected)
                    and (combination != "one" or all(self._close(v, expected) for v in values))]
            report["combinations"][key], report["fx"][key] = fits, fx
            if not fits:
                differences.append(f"{key!r} (reduce_fx={fx!r}): {_show(expected)} whole,"
                                   f" {_show(_combine(fx, values, sharded.logs[key][1]))} from the shards"
                                   f" ({', '.join(_show(v) for v in values)})")
        return report

    def _module_line(self, owner: str, reports: list[dict[str, Any]]) -> str:
        """Which module's output first differs on a shard, and what that says it does; or that none does."""
        found = [r["module"] for r in reports if r["module"] is not None]
        if not found:
            return (f"Every module's output on the shard equals the whole run's at the same tokens: the difference is"
                    f" made in {owner} itself, outside the model's forward.")
        first = min(found, key=lambda m: m["index"])
        name = f"{first['fqn'] or 'the module'} ({first['class']})"
        if first["what"] == "length":
            whole_shape, shard_shape = first["shapes"]
            return (f"{name} is the first module whose output differs: {shard_shape} on the shard, where the whole run"
                    f" gives {whole_shape}, so it was handed a sequence of another length than the rank's tokens"
                    " (a slice of the sequence dim before it, in the step or in the forward).")
        if first["what"] == "no_sequence":
            matched = sorted({r["cp_rank"] for r in reports
                              if r["module"] is None or (r["module"]["index"], r["module"]["fqn"])
                              != (first["index"], first["fqn"])})
            holder = next((r for r in reports if r["cp_rank"] in matched), None) if len(matched) == 1 else None
            held = [what for what, holds in zip(("first", "last"), holder["ends"] if holder else ()) if holds]
            reads = (f" It gives the whole run's output only on cp rank {matched[0]}, which holds the sequence's"
                     f" {' and '.join(held)} token{'s' if len(held) > 1 else ''}: it reads"
                     f" {'one of them' if len(held) > 1 else 'it'} (a pooler reading the first token, a head reading"
                     " the last)." if held else "")
            return (f"{name} is the first module whose output differs: its output has no sequence dim, so it"
                    f" combines or picks tokens of the sequence, of which each cp rank holds only part.{reads}")
        return (f"{name} is the first module whose output differs from the whole run's at the same tokens: it"
                " computes from where a token sits or from the length it sees (torch.arange(x.size(1)), x.size(1),"
                " a slice), not from the tokens alone.")

    def _decide(self, name: str, reports: list[dict[str, Any]], sharded: _Seen, length: int) -> None:
        """The same outcome on every rank: go on (learning a logged value's combination), skip, or raise."""
        owner = f"{type(self.module).__name__}.{name}"
        cp = self.context.size
        failed_whole = next((r for r in reports if r["whole_error"] is not None), None)
        if failed_whole is not None:
            rank_zero_warn(f"cp={cp}: the step check could not run {owner} on the whole sample with context"
                           f" parallelism off (rank {failed_whole['rank']}: {failed_whole['whole_error']}), so it did"
                           " not compare the sharded step with one process's. (A manual-optimization step that reads"
                           " gradients after manual_backward cannot run without them.)")
            return
        failed = next((r for r in reports if r["sharded_error"] is not None and not r["peer"]), None)
        if failed is not None:
            error = None if _from_peer(sharded.error) else sharded.error
            if error is not None and getattr(error, MODEL_REFUSAL, False):
                raise error
            explanation = (f"{owner} fails on this rank's shard of the sequence but runs on the whole sample with"
                           f" context parallelism off (cp={cp}: the step check ran it both ways on the first batch,"
                           " before any weight changed), so the step or the model's forward builds something from"
                           f" the tokens it sees. Usual causes: {CAUSES}. Fixes that work: {FIXES}. To train anyway:"
                           " FourDStrategy(cp_check=False), at your own risk, or cp=1.")
            if error is None:  # another rank's error, of its type where that is a builtin one
                kind = getattr(builtins, failed["sharded_error"].split(":")[0], RuntimeError)
                kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
                raise _with_message(kind(), f"{explanation} What failed on the shard of rank {failed['rank']}:"
                                            f" {failed['sharded_error']}")
            raise _with_message(error, f"{explanation} What failed on the shard: {type(error).__name__}: {error}")
        mismatch = next((r for r in reports if r["differences"]), None)
        if mismatch is not None:
            lines = "\n".join(f"  - {line}" for line in mismatch["differences"])
            raise StepMismatch(
                f"Context parallelism (cp={cp}) changes what {owner} computes. The step check ran it on a sample of"
                f" the first batch ({length} tokens per sequence) without gradients, sharded as training runs it and"
                f" whole with context parallelism off, as one process; on rank {mismatch['rank']} it gives"
                f"\n{lines}\n{self._module_line(owner, reports)}\nNo weight has changed. The step (or the model's"
                f" forward) computes something from where"
                f" a token sits or from the length it sees, which on a shard are not the whole sequence's. Usual"
                f" causes: {CAUSES}. Fixes that work: {FIXES}. To train anyway: FourDStrategy(cp_check=False), at"
                " your own risk, or cp=1.")
        self._learn(owner, reports)

    def _learn(self, owner: str, reports: list[dict[str, Any]]) -> None:
        """A logged value that only another combination over the cp ranks gives one process's value on every
        rank is combined that way from now on."""
        keys = dict.fromkeys(key for r in reports for key in r["combinations"])
        for key in keys:
            fits = [set(r["combinations"].get(key, ())) for r in reports if key in r["combinations"]]
            common = set.intersection(*fits) if fits else set()
            configured = next(r["fx"][key] for r in reports if key in r["fx"])
            if configured in common or not common:
                continue
            learned = next(c for c in _LEARNABLE if c in common)
            self.context.log_reductions[key] = learned
            meaning = ("is the same on every shard, so it is taken once instead of combined over the cp ranks"
                       if learned == "one" else "is the shards' sum, so it is summed over the cp ranks")
            rank_zero_info(f"cp={self.context.size}: {owner} logs {key!r}, whose value on the whole sequence {meaning}"
                           " (learned by the step check on the first batch).")


# Relative bound on a summary (sum, sum of magnitudes, sum of squares) of a module's tensors: looser than a value's,
# as sums of many elements gather the round-off of ring against whole-sequence attention. It only names a module.
SUMMARY_RTOL = 1e-4


class _Summaries:
    """Summaries of each module call's floating-point inputs and outputs (sum, sum of magnitudes, sum of squares,
    in float64, and the shape), kept instead of the tensors: a check of a large model stores a few numbers per
    call. For the whole run, ``positions`` (of ``length``) cut each sequence tensor to this rank's tokens first."""

    def __init__(self, dim: int, length: Optional[int] = None, positions: Optional[Tensor] = None) -> None:
        self.dim, self.length, self.positions = dim, length, positions

    def of(self, tensor: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], bool, Tensor]:
        """(its shape, the shape compared, whether it was cut to this rank's tokens, its summary)"""
        shape, sequence = tuple(tensor.shape), False
        if self.positions is not None and tensor.dim() > self.dim and tensor.size(self.dim) == self.length:
            tensor, sequence = tensor.index_select(self.dim, self.positions.to(tensor.device)), True
        values = tensor.detach().double()
        return shape, tuple(tensor.shape), sequence, torch.stack([values.sum(), values.abs().sum(),
                                                                  values.square().sum()])

    def recorder(self, calls: list, fqn: str) -> Callable:
        def summarized(value: Any) -> list:
            return [self.of(t) for t in _output_tensors(value) if type(t) is Tensor and t.is_floating_point()]

        def record(module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
            calls.append((fqn, type(module).__name__, summarized((args, kwargs)), summarized(output)))

        return record


def _first_different_module(whole: list, sharded: list) -> Optional[dict[str, Any]]:
    """The module that makes the first difference: among the calls whose output on this rank's shard differs from
    the whole run's at the same tokens (or, without a sequence dim, from the whole run's output), the first (in the
    order calls ended: the innermost first) whose floating-point inputs still matched; else the first whose output
    differs; None when every call matches. Calls are matched by module and order."""
    first = None
    for index, ((fqn, kind, want_in, want_out), (shard_fqn, _, have_in, have_out)) in enumerate(zip(whole, sharded)):
        if fqn != shard_fqn:
            break  # the two runs called other modules: no call-by-call comparison from here
        difference = _difference(want_out, have_out)
        if difference is None:
            continue
        found = {"index": index, "fqn": fqn, "class": kind, **difference}
        if _difference(want_in, have_in) is None:
            return found
        first = first or found
    return first


def _difference(expected: list, got: list) -> Optional[dict[str, Any]]:
    """How this rank's tensors differ from the whole run's at the same tokens, by their summaries (None: not)."""
    for (shape, compared, sequence, want), (shard_shape, _, _, have) in zip(expected, got):
        if compared != shard_shape:
            if sequence:  # the shard's tensor is not this rank's tokens of the whole one
                return {"what": "length", "shapes": (shape, shard_shape)}
            continue  # a layout this comparison does not know (a sequence already split over tp)
        want, have, numel = want.tolist(), have.tolist(), math.prod(shard_shape)
        bounds = (want[1], want[1], want[2])  # the sum is bounded by the sum of magnitudes
        if not all(abs(a - b) <= SUMMARY_RTOL * bound + 1e-6 * numel for a, b, bound in zip(want, have, bounds)):
            return {"what": "tokens" if sequence else "no_sequence"}  # (NaN never compares as close)
    return None


def _output_tensors(output: Any) -> list[Any]:
    """The tensors of a module's output: itself, or those in its tuple, list, dict or Hugging Face output."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in _output_tensors(value)]
    if isinstance(output, (tuple, list)):
        return [t for value in output for t in _output_tensors(value)]
    return []


def _floats(value: Tensor) -> list[float]:
    return value.detach().reshape(-1).double().cpu().tolist()


def _show(values: Optional[list[float]]) -> str:
    if values is None:
        return "nothing"
    shown = ", ".join(f"{v:.6g}" for v in values[:4]) + (", ..." if len(values) > 4 else "")
    return shown if len(values) == 1 else f"[{shown}]"


def _combine(fx: str, values: list[list[float]], own: Optional[list[float]]) -> Optional[list[float]]:
    """``values`` (one list per cp rank) combined elementwise as ``fx`` combines them; ``"one"``: this rank's."""
    if fx == "one" or own is None or not values:
        return own
    columns = list(zip(*values))
    combine = {"mean": lambda c: sum(c) / len(c), "sum": sum, "max": max, "min": min}[fx]
    return [combine(column) for column in columns]


def _from_peer(error: Optional[BaseException]) -> bool:
    """The error only says that another rank failed (``peer_failure``, on it or on what it was raised from)."""
    while error is not None:
        if getattr(error, "peer_failure", False):
            return True
        error = error.__cause__
    return False


def _describe(error: Optional[BaseException]) -> Optional[str]:
    return None if error is None else f"{type(error).__name__}: {error}"


def _with_message(error: BaseException, message: str) -> BaseException:
    """An exception of ``error``'s type with ``message`` (a RuntimeError where that type takes no message)."""
    try:
        new = type(error)(message)
    except Exception:  # noqa: BLE001  a type with another constructor
        new = RuntimeError(message)
    new.__cause__ = error
    return new


@contextmanager
def _without_trace(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Around one run of the check: no gradients, eval mode (no dropout), no autocast and no TF32 (fp32
    round-off), no optimizer, scheduler or ``manual_backward`` effect; afterwards the modes, every torchmetrics
    state and every random stream are as they were."""
    from torchmetrics import Metric

    streams = compat.rng_states()
    modes = [(m, m.training) for m in module.modules()]
    metrics = [(m, compat.metric_snapshot(m)) for m in module.modules() if isinstance(m, Metric)]
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    module.eval()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.autocast(device.type, enabled=False))
            stack.enter_context(_steps_disabled(module))
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        for m, training in modes:
            m.training = training
        for m, snapshot in metrics:
            compat.restore_metric(m, snapshot)
        compat.set_rng_states(streams)


@contextmanager
def _steps_disabled(module: nn.Module) -> Iterator[None]:
    """``manual_backward``, ``clip_gradients``, the optimizers' ``step``/``zero_grad`` and the schedulers' ``step``
    do nothing (instance attributes shadow the methods while the check runs)."""
    owners: list[tuple[Any, str]] = []
    trainer = _trainer_of(module)
    if trainer is not None:
        owners += [(module, "manual_backward"), (module, "clip_gradients")]
        optimizers = module.optimizers(use_pl_optimizer=True) if trainer.strategy.optimizers else []
        owners += [(o, n) for o in (optimizers if isinstance(optimizers, list) else [optimizers])
                   for n in ("step", "zero_grad")]
        owners += [(config.scheduler, "step") for config in trainer.lr_scheduler_configs]
    shadowed = [(owner, name, name in vars(owner), vars(owner).get(name)) for owner, name in owners]
    for owner, name in owners:
        setattr(owner, name, _nothing)
    try:
        yield
    finally:
        for owner, name, had, value in shadowed:
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


def _trainer_of(module: nn.Module) -> Any:
    if not isinstance(module, LightningModule):
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


def _nothing(*_: Any, **__: Any) -> None:
    return None
