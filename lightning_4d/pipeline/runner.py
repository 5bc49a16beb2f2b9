"""The replayed, hook-truncated step: every stage runs the user's own step method on each micro-batch.

A ``torch.distributed.pipelining`` stage calls :class:`_StageModule` with a micro-batch index. That runs the
user's unchanged ``training_step`` (or ``validation_step``, ...) on the micro-batch, with the block list
holding only the stage's blocks. Everything before the blocks (embeddings, masks, rotary tables, position
ids) is recomputed locally, so only the hidden state crosses stage boundaries: a forward pre-hook on the
stage's first block replaces the hidden state by the activation received from the previous stage, and a
forward hook on its last block stops the step by raising :class:`_StageExit` with the activation to send.
On the last stage the step runs to its end and returns the user's loss, which the schedule backpropagates.

Shapes at stage boundaries are given to the schedule statically. They are learned once per batch shape by
running micro-batch 0 on the first stage for real (the schedule then reuses that forward) and broadcasting
the activation's shape: no user code ever runs on placeholder tensors, and a torchmetrics metric is updated
exactly once per micro-batch.

Lightning's closure calls ``zero_grad`` after ``training_step`` and before ``backward``, but the schedule
computes the gradients inside ``training_step``. So the fresh gradients are set aside after the schedule
(:meth:`PipelineRunner.step`) and committed in the strategy's ``backward`` (:meth:`commit_gradients`), which
keeps zero_grad, gradient accumulation and the backward hooks where Lightning puts them. (On the first batch of an
accumulation window :meth:`~lightning_4d.composition.parallel_model.ParallelModel.step` frees the gradients that zero_grad would
clear before the schedule runs, so there are none to set aside.)

Logs: ``self.log`` calls are recorded per micro-batch (:class:`~lightning_4d.numerics.step_logging.StepLogs`). Only the
last stage ran the whole step; it merges its records and sends them with the step's output to every stage
(:mod:`.results`: device tensors by broadcast, their structure through the store), and every stage replays
identical ``log`` calls, so ``sync_dist``, ModelCheckpoint and
EarlyStopping see the same keys on every rank and rank 0 (a first stage) logs the real values.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from lightning_4d import _compat as compat
from lightning_4d.parallel_dims import ParallelMesh
from lightning_4d.pipeline.microbatch import detached, merge, shape_key, split_batch
from lightning_4d.pipeline.plan import PipelinePlan
from lightning_4d.pipeline.results import ResultExchange
from lightning_4d.pipeline.split import split_module
from lightning_4d.numerics.step_logging import StepLogs
from lightning_4d.numerics.token_losses import TOKENS_ATTRIBUTE, TokenMeanLosses

_CACHED_SCHEDULES = 4  # one per batch shape seen recently, for training and for evaluation


class _StageExit(BaseException):
    """Ends the user's step after the stage's last block; a BaseException, so ``except Exception`` in user
    code cannot swallow it."""

    def __init__(self, hidden: Tensor) -> None:
        self.hidden = hidden


@dataclass
class _Running:
    """The stage currently executing on this rank."""

    stage: int
    hidden: Optional[Tensor]  # the received activation, until the first block consumes it
    injected: bool = False


class _MetricRef(NamedTuple):
    """A logged torchmetrics Metric, by its module name (the object itself cannot cross processes)."""

    name: str


class _StageModule(nn.Module):
    """What a ``PipelineStage`` runs. Its parameters are exactly those the stage's computation uses: the
    zero-bubble schedules compute weight gradients for these and nothing else."""

    def __init__(self, run: Callable[[int, int, Optional[Tensor]], Tensor], stage: int,
                 params: Callable[[int], list[nn.Parameter]]) -> None:
        super().__init__()
        self._run = run
        self.stage = stage
        self._params = params

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(self._params(self.stage))

    def forward(self, hidden: Tensor, mb: Tensor) -> Tensor:
        return self._run(self.stage, int(mb), None if self.stage == 0 else hidden)


class PipelineRunner:
    """Cuts ``module`` down to this rank's stages (as ``plan`` says) and runs its step methods through pipeline
    schedules. The caller enters the step's contexts (tensor and context parallelism) around :meth:`step`."""

    def __init__(self, module: LightningModule, plan: PipelinePlan, mesh: ParallelMesh, device: torch.device) -> None:
        self.module = module
        self.plan = plan
        self.config = plan.config
        self.device = device
        self.group = mesh.group("pp")
        ranks = plan.stage_ranks
        self.local_stages = plan.stages_of(mesh.local_rank("pp"))
        self.split = split_module(module, plan, self.local_stages, device)
        self.last = plan.last
        self.holds_last = self.last in self.local_stages
        self._last_rank = dist.get_global_rank(self.group, ranks[-1])
        self._first_rank = dist.get_global_rank(self.group, ranks[0])
        # A weight kept by the first and the last stage gets its gradient from both.
        self._ends_group = mesh.pipeline_pair(ranks[0], ranks[-1]) if plan.has_ends else None
        self._stage_modules = {s: _StageModule(self._run_stage, s, self.split.params_of) for s in self.local_stages}
        for name, stubbed, role in self.split.stubbed:
            stubbed.register_forward_pre_hook(self._placement_check(name, role))
        from torchmetrics import Metric

        # Only the last stage updates metrics (they sync over pp_dp_cp).
        self._metrics = {name: m for name, m in module.named_modules() if isinstance(m, Metric)}
        self._schedules: OrderedDict[tuple, tuple[Any, tuple]] = OrderedDict()
        self._logs = StepLogs(module)
        self._results = ResultExchange(self.group, self._last_rank, device)
        self._running: Optional[_Running] = None
        self._ready: dict[int, Tensor] = {}  # micro-batch 0's activation, when a new batch shape ran it early
        # What _inject swapped in during this training step, by the id of the tensor it replaced: a checkpointed
        # block's recomputation during backward (non-reentrant: called with the same objects) gets it again. An
        # entry lives as long as the replaced tensor does (a checkpoint keeps it until its backward; otherwise
        # nothing does), so no micro-batch's activation is held longer than without it.
        self._injected: dict[int, tuple[weakref.ref, Tensor]] = {}
        self._outputs: dict[int, Any] = {}
        # The last stage's metrics: a copy of each, updated with every micro-batch a step passes to the metric's
        # forward, gives the step's value on the whole batch (not the mean of the micro-batches' values, which is
        # another number for Perplexity, F1, ...); the names whose forward ran this step.
        self._step_copies: dict[str, Any] = {}
        self._forwarded: set[str] = set()
        self._boundary: Optional[tuple] = None
        self._params: list[nn.Parameter] = []  # the module's parameters as of the last training step
        self._pending: Optional[list[Optional[Tensor]]] = None
        self._call: Optional[Callable[[int], Any]] = None  # the user's step on micro-batch i, set per step
        self._training = False
        self._loss_scale = 1.0
        self._token_losses: Optional[TokenMeanLosses] = None  # this training step's token-mean losses
        self._loss_mode: Optional[TokenMeanLosses] = None  # this step's, training or not: entered on the last stage
        self._token_window = False  # the step's gradients are divided by its accumulation window's count
        self.token_count: Optional[Tensor] = None  # the valid targets of the last training batch, over dp x cp
        # Called with (micro-batch index, micro-batches) before each micro-batch's forward, by whoever needs to
        # know which rows of the step's batch run (context parallelism's masks).
        self.before_microbatch: Optional[Callable[[int, int], None]] = None
        self._token_counts: dict[int, Tensor] = {}  # micro-batch -> the count its returned loss averages over
        self._grad_scale: Optional[float] = None  # what the step's gradients are multiplied by when committed
        self._token_problem: Optional[str] = None  # why this step's token-mean loss cannot be weighted

    def finish_sending(self) -> None:
        """The last stage's step results sent (it does not wait for that in the step; see :mod:`.results`)."""
        self._results.finish_sending()

    def hook_boundaries(self) -> None:
        """The stage-boundary hooks on the blocks, once everything else has hooked them (sharding's hooks): the
        received activation replaces the block input before any other pre-hook sees it, and the stage stops
        after every other forward hook ran. They stay for the module's lifetime; outside a step they do nothing."""
        for s, blocks in self.split.chunks.items():
            first_block, last_block = next(iter(blocks.values())), next(reversed(blocks.values()))
            if s != 0:
                first_block.register_forward_pre_hook(self._inject, with_kwargs=True, prepend=True)
            if s != self.last:
                last_block.register_forward_hook(self._stop)

    # ------------------------------------------------------------------------------- one step

    def step(self, method: str, args: tuple, kwargs: dict, accumulate_grad_batches: int = 1,
             around: Callable[[bool], AbstractContextManager[None]] = lambda training: nullcontext(),
             token_losses: Optional[TokenMeanLosses] = None, forward_only: bool = False) -> Any:
        """Run ``module.<method>`` on every micro-batch of ``args[0]`` through the pipeline; returns the step
        output on every rank (the merged outputs of the micro-batches, computed on the last stage). Training
        losses are scaled by ``1 / (micro-batches * accumulate_grad_batches)``, as one process averages them.
        ``around(training)`` is entered around the schedule (sharded data parallelism gathers and reduces there);
        the gradients are set aside after it. ``token_losses`` (deferred): token-mean losses count every valid
        target of the whole batch once; the step's gradients are divided by the batch's count when committed, and
        the micro-batches' logged losses are combined weighted by their counts (in evaluation steps too).
        ``forward_only``: a training step run like an evaluation step (no backward; context parallelism's step
        check)."""
        training = self._training = method == "training_step" and not forward_only
        n = self.config.num_microbatches
        micro = split_batch(args[0], n)
        user_step = getattr(self.module, method)
        self._call = lambda index: user_step(micro[index], *args[1:], **kwargs)
        counts = {name: compat.metric_update_count(m) for name, m in self._metrics.items()}
        with self._metric_copies():
            return self._run(method, training, n, micro, counts, accumulate_grad_batches, around, token_losses,
                             forward_only)

    def _run(self, method: str, training: bool, n: int, micro: list, counts: dict[str, int],
             accumulate_grad_batches: int, around: Callable[[bool], AbstractContextManager[None]],
             token_losses: Optional[TokenMeanLosses], forward_only: bool) -> Any:
        index = torch.arange(n, device=self.device)
        on_host = torch.arange(n)  # each stage reads its micro-batch's index as an int: from host memory, no sync
        self._token_losses, self._token_counts, self._token_problem = token_losses if training else None, {}, None
        self._loss_mode = token_losses
        self._token_window = token_losses is not None and token_losses.window
        if training:
            self._grad_scale = None
            self._loss_scale = 1.0 / (n * accumulate_grad_batches)
            self._params = list(self.module.parameters())
            earlier = self._take_grads()
            try:
                with around(True):
                    schedule = self._schedule(training, shape_key(micro[0]))
                    schedule.step(index, mb=on_host, target=index, return_outputs=False)
            finally:
                self._injected.clear()
                self._pending = self._take_grads()
                for p, grad in zip(self._params, earlier):
                    p.grad = grad
        else:  # token-mean losses are only weighted for what is logged
            with around(False):
                if forward_only:
                    self._forward_stage_by_stage(n)
                else:
                    self._schedule(training, shape_key(micro[0])).step(index, mb=on_host, return_outputs=False)
        return self._finish(n, counts)

    def _forward_stage_by_stage(self, n: int) -> None:
        """A training step's forward pass for the step check: one stage after another, each running every
        micro-batch, the pipeline group agreeing after each stage whether it failed. A failure on a stage (a mask
        a sequence shard cannot carry) then stops every stage, where a schedule would leave the next stage
        waiting for an activation; the activations travel by broadcast over the pipeline group."""
        self._boundary = None
        hidden: dict[int, Tensor] = {}
        for stage, pp_rank in enumerate(self.plan.stage_ranks):
            error = None
            if stage in self.local_stages:
                try:
                    hidden = {index: self._run_stage(stage, index, hidden.get(index)) for index in range(n)}
                except Exception as failure:  # noqa: BLE001  raised below, once the group knows
                    error = failure
            flag = torch.tensor([float(error is not None)], device=self.device)
            dist.all_reduce(flag, group=self.group)
            if flag.item() > 0:  # the step check's first batch only, never a training step
                if error is None:
                    error = RuntimeError(f"Pipeline stage {stage} failed in the step check's forward pass on another"
                                         " rank (its error is reported there)")
                    error.peer_failure = True  # the step check reports the other rank's error instead
                raise error
            if stage == self.last:
                return
            source = dist.get_global_rank(self.group, pp_rank)
            shape: list[Any] = [(tuple(hidden[0].shape), hidden[0].dtype) if stage in self.local_stages else None]
            dist.broadcast_object_list(shape, src=source, group=self.group)
            hidden = {index: hidden[index] if stage in self.local_stages
                      else torch.empty(shape[0][0], dtype=shape[0][1], device=self.device) for index in range(n)}
            for index in range(n):
                dist.broadcast(hidden[index], src=source, group=self.group)

    @contextmanager
    def _metric_copies(self) -> Iterator[None]:
        """On the last stage, while the step runs: each metric's forward also updates its step copy."""
        shadowed = []
        self._forwarded.clear()
        if self.holds_last:
            for name, metric in self._metrics.items():
                copy = self._step_copies.get(name)
                if copy is None:
                    copy = self._step_copies[name] = compat.MetricOnBatch(metric)
                copy.reset()
                metric.forward = self._forward_into(name, metric, copy)
                shadowed.append(metric)
        try:
            yield
        finally:
            for metric in shadowed:
                del metric.forward

    def _forward_into(self, name: str, metric: Any, copy: Any) -> Callable[..., Any]:
        original = type(metric).forward.__get__(metric)

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._forwarded.add(name)
            copy.update(*args, **kwargs)
            return original(*args, **kwargs)

        return forward

    def _schedule(self, training: bool, key: tuple) -> Any:
        key = (training, key)
        if key not in self._schedules:
            self._boundary = None
            boundary = self._learn_boundary()
            self._schedules[key] = (self._build(training, boundary), boundary)
            if len(self._schedules) > _CACHED_SCHEDULES:
                self._schedules.popitem(last=False)
        self._schedules.move_to_end(key)
        schedule, self._boundary = self._schedules[key]
        return schedule

    def _learn_boundary(self) -> tuple:
        """Shape and dtype of the activation between stages, from a real forward of micro-batch 0."""
        info: list[Any] = [None]
        error = None
        if 0 in self.local_stages:
            try:
                hidden = self._ready[0] = self._run_stage(0, 0, None)
                info[0] = (tuple(hidden.shape), hidden.dtype)
            except Exception as failure:  # every stage raises, instead of the others waiting for a shape
                error, info[0] = failure, f"{type(failure).__name__}: {failure}"
        dist.broadcast_object_list(info, src=self._first_rank, group=self.group)
        if error is not None:
            raise error
        if isinstance(info[0], str):
            raise RuntimeError(f"Pipeline stage 0 failed on micro-batch 0 of the step: {info[0]}")
        return info[0]

    def _build(self, training: bool, boundary: tuple) -> Any:
        shape, dtype = boundary
        count = self.config.num_stages

        def example(stage_shape: tuple, stage_dtype: torch.dtype) -> Tensor:
            return torch.empty(stage_shape, dtype=stage_dtype, device="meta", requires_grad=training)

        stages = []
        for s in self.local_stages:
            inputs = torch.zeros(1, dtype=torch.long, device="meta") if s == 0 else example(shape, dtype)
            outputs = example((), torch.float32) if s == self.last else example(shape, dtype)
            stages.append(PipelineStage(self._stage_modules[s], s, count, self.device, input_args=inputs,
                                        output_args=outputs, group=self.group))
        spec = self.config.spec
        return spec.cls(stages if spec.stages_per_rank != 1 else stages[0], self.config.num_microbatches,
                        loss_fn=self._scaled_loss if training else None, scale_grads=False)

    def _scaled_loss(self, loss: Tensor, _: Tensor) -> Tensor:
        # The mean over micro-batches (and over accumulated batches) of the user's loss, as in one process.
        return loss * self._loss_scale

    # ------------------------------------------------------------------------ one stage, one micro-batch

    def _run_stage(self, stage: int, index: int, hidden: Optional[Tensor]) -> Tensor:
        if stage == 0 and index in self._ready:
            return self._ready.pop(index)
        logs = self._logs if stage == self.last else StepLogs(self.module)
        self._running = _Running(stage, hidden)
        self.split.enter(stage)
        try:
            if self.before_microbatch is not None:
                self.before_microbatch(index, self.config.num_microbatches)
            # token-mean losses are watched for only where the step reaches its loss (the other stages stop at their
            # last block)
            watch = self._loss_mode if stage == self.last and self._loss_mode is not None else nullcontext()
            with logs.recording(index if stage == self.last else None), watch:
                output = self._call(index)
        except _StageExit as stop:
            return stop.hidden
        finally:
            running, self._running = self._running, None
            self.split.rest()
        if stage != self.last:
            raise RuntimeError(f"Pipeline stage {stage}: the step method returned without running the last block"
                               f" of the stage in {self.split.path}; under pipeline parallelism every step must run"
                               " the model's blocks.")
        if stage != 0 and not running.injected:
            raise RuntimeError(f"Pipeline stage {stage}: the step never called the first block of the stage in"
                               f" {self.split.path}, so it did not use the activation of the previous stage.")
        self._outputs[index] = detached(output)
        if self._training:
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, Tensor):
                raise RuntimeError("Under pipeline parallelism training_step must return the loss (a tensor, or a"
                                   f" dict with a 'loss' tensor); it returned {type(output).__name__}. Skipping a"
                                   " batch by returning None is not supported.")
            self._check_token_loss(index, loss)
            return loss
        return torch.zeros((), device=self.device)  # the forward-only schedule needs a tensor

    def _inject(self, block: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """The received activation in place of the block's input. A block forward outside the stage's run is a
        checkpoint's recomputation during backward: a model's own checkpointing (Hugging Face's wraps each
        layer's ``__call__``, so this hook runs inside it) recomputes from the input it was first called with,
        which this hook replaced then; it gets the same activation again, not the locally computed one."""
        first = None if args else next(iter(inspect.signature(block.forward).parameters))
        given = args[0] if args else kwargs.get(first)
        running = self._running
        if running is None or running.hidden is None:
            replay = self._injected.get(id(given)) if isinstance(given, Tensor) else None
            if replay is None or replay[0]() is not given:
                return None
            hidden = replay[1]
        else:
            hidden, running.hidden, running.injected = running.hidden, None, True
            if self._training and isinstance(given, Tensor):
                key = id(given)
                self._injected[key] = (weakref.ref(given, lambda _, key=key: self._injected.pop(key, None)), hidden)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, first: hidden}

    def _stop(self, block: nn.Module, args: tuple, output: Any) -> None:
        if self._running is None:
            return
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(hidden, Tensor) or isinstance(hidden, DTensor):
            raise TypeError(f"Pipeline stage boundary after a block of {self.split.path}: the block returned"
                            f" {type(hidden).__name__}, but only a plain tensor hidden state (or a tuple that"
                            " starts with one) can be sent to the next stage.")
        if self._boundary is not None and (tuple(hidden.shape), hidden.dtype) != self._boundary:
            raise ValueError(f"Pipeline stage {self._running.stage} produced an activation of shape"
                             f" {tuple(hidden.shape)} ({hidden.dtype}) where micro-batch 0 gave {self._boundary}:"
                             " the blocks must keep the hidden state's shape, and every micro-batch must have the"
                             " same shapes.")
        raise _StageExit(hidden if hidden.is_contiguous() else hidden.contiguous())

    def _placement_check(self, name: str, role: str) -> Callable:
        def check(module: nn.Module, args: tuple) -> None:
            running = self._running
            if running is None:
                return
            if role == "suffix" or running.injected:
                side, other = ("after", "before") if role == "suffix" else ("before", "after")
                raise RuntimeError(
                    f"{name} was placed {side} the block list {self.split.path} but runs {other} it. Pipeline"
                    " parallelism places a module outside the blocks by where the forward of the module holding"
                    " both first uses it, or, where that forward does not name it, by registration order; call it"
                    " from that forward, or register it on the side where it runs.")

        return check

    # ------------------------------------------------------------------------------ step results

    def _check_token_loss(self, index: int, loss: Tensor) -> None:
        """A deferred token-mean loss divides the whole step's gradients by the batch's count, so the loss the
        schedule backpropagates must be that loss itself (any other term would be divided too). A problem is
        kept for :meth:`_finish`, which raises it on every stage alike."""
        if self._token_losses is None:
            return
        count = getattr(loss, TOKENS_ATTRIBUTE, None)
        if count is not None:
            self._token_counts[index] = count
        elif self._token_losses.counts:
            self._token_problem = (
                "Under pipeline parallelism with loss_normalization='tokens', training_step must return the"
                " token-mean cross entropy it computed (F.cross_entropy / F.nll_loss with reduction='mean', or a"
                " Hugging Face model's loss) as it is: the step returned a loss computed from it (e.g. with another"
                " term added), whose other terms cannot be weighted like one process. Return the cross entropy"
                " alone, or use FourDStrategy(loss_normalization='replica') (each rank's mean, as DDP).")

    def _token_weighted(self, outputs: list[Any]) -> list[Any]:
        """Each micro-batch's token-mean loss weighted by its count, so that merging (a mean) gives the batch's
        token mean, as one process computes it."""
        if not outputs or len(self._token_counts) != len(outputs):
            return outputs
        total = torch.stack(list(self._token_counts.values())).sum()
        factors = [self._token_counts[i] * len(outputs) / total for i in range(len(outputs))]
        return [{**out, "loss": out["loss"] * f} if isinstance(out, Mapping) else out * f
                for out, f in zip(outputs, factors)]

    def _finish(self, n: int, counts: dict[str, int]) -> Any:
        local = None  # the source keeps its own objects; the others get copies
        if self.holds_last:
            outputs = [self._outputs.pop(i) for i in range(n)]
            outputs = self._token_weighted(outputs)
            logs = {name: (_MetricRef(self._metric_name(value)) if not isinstance(value, Tensor) else value, kw)
                    for name, (value, kw) in self._logs.combined().items()}
            updates = {name: (compat.metric_update_count(m) - counts[name],
                              self._step_copies[name].compute() if name in self._forwarded else None)
                       for name, m in self._metrics.items() if compat.metric_update_count(m) != counts[name]}
            batch_count = self._token_losses.batch_count() if self._token_losses is not None else None
            local = (merge(outputs), logs, updates, batch_count, self._token_problem)
        output, logs, updates, batch_count, problem = self._results.exchange(local)
        self._token_problem = None
        if problem is not None:
            raise ValueError(problem)
        self.token_count = batch_count if self._training else None
        # Every stage divides the step's gradients by the batch's count (under a TokenWindow: by the window's, later).
        if batch_count is not None and self._training:
            self._grad_scale = n if self._token_window else n / batch_count
        for name, (count, forward_cache) in updates.items():
            metric = self._metrics[name]
            if not self.holds_last:
                # This rank never saw the data; its (default) state adds nothing when the metric syncs over
                # the pipeline and data-parallel ranks, but it must know that the metric was updated.
                compat.count_metric_updates(metric, count)
            if forward_cache is not None:
                compat.set_metric_forward_cache(metric, forward_cache)
        self._logs.replay({name: (self._metrics[value.name] if isinstance(value, _MetricRef) else value, kw)
                           for name, (value, kw) in logs.items()})
        return output

    def _metric_name(self, value: Any) -> str:
        for name, metric in self._metrics.items():
            if metric is value:
                return name
        raise ValueError(f"Under pipeline parallelism a logged {type(value).__name__} must be a torchmetrics Metric"
                         " that is an attribute of the LightningModule, so that every stage can log it.")

    # -------------------------------------------------------------------------------- gradients

    def _take_grads(self) -> list[Optional[Tensor]]:
        grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        return grads

    def commit_gradients(self) -> None:
        """Add the gradients of the last pipeline step to ``.grad`` (Lightning's ``backward``)."""
        if self._pending is None:
            raise RuntimeError("backward ran without a pipeline training_step before it; under pipeline"
                               " parallelism backward only commits the gradients the schedule computed.")
        pending, self._pending = self._pending, None
        if self._grad_scale is not None:  # in place: the pending gradients are this runner's alone
            for grad in pending:
                if grad is not None:
                    grad.mul_(self._grad_scale)
        if self._ends_group is not None:
            pending = self._sum_over_ends(pending)
        for p, grad in zip(self._params, pending):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad

    def _sum_over_ends(self, pending: list[Optional[Tensor]]) -> list[Optional[Tensor]]:
        """The gradients of the weights both end stages keep, summed over the two, without the host waiting: the
        sum is waited for on the device where it is used. After the values go one count per weight of the stages
        that formed its gradient, written on the device; only a weight without a gradient on this stage needs its
        count read on the host (a gradient on the other stage: it gets that one; none anywhere: it keeps
        ``grad=None``, as one process would), so the usual step, both stages using the weight, reads nothing."""
        ends = [p for p in self.split.ends() if p.requires_grad]  # a frozen weight has no gradient to sum
        position = {id(p): i for i, p in enumerate(self._params)}  # tensor parallelism replaces parameters
        by_dtype: dict[torch.dtype, list[tuple[int, nn.Parameter]]] = {}
        for p in ends:
            by_dtype.setdefault(_local(p).dtype, []).append((position[id(p)], p))
        for members in by_dtype.values():  # one all-reduce per dtype (usually one)
            pieces = [_local(p).new_zeros(_local(p).numel()) if pending[i] is None else _local(pending[i]).reshape(-1)
                      for i, p in members]
            flat = torch.cat([*pieces, pieces[0].new_ones(len(members))])
            offset = flat.numel() - len(members)
            missing = [slot for slot, (i, _) in enumerate(members) if pending[i] is None]
            for slot in missing:
                flat[offset + slot].zero_()
            summed = compat.waited(compat.all_reduce_in_stream(flat, "sum", self._ends_group))
            formed = set(range(len(members))) - set(missing)
            if missing:  # read only here: whether the other stage formed what this one did not
                formed |= {slot for slot, count in zip(missing, summed[offset:][missing].tolist()) if count > 0}
            offset = 0
            for slot, (i, p) in enumerate(members):
                shard = _local(p)
                if slot in formed:
                    total = summed[offset:offset + shard.numel()].view_as(shard)
                    pending[i] = DTensor.from_local(total, p.device_mesh, p.placements, shape=p.shape,
                                                    stride=p.stride()) if isinstance(p, DTensor) else total
                offset += shard.numel()
        return pending

    def counted_on_another_stage(self) -> list[nn.Parameter]:
        """Weights whose gradient norm another rank of the pipeline group counts already (kept by the first and
        the last stage: the first one counts them)."""
        return self.split.ends() if self._ends_group is not None and 0 not in self.local_stages else []


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor

