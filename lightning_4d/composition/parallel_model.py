"""What a module made parallel by :func:`~lightning_4d.composition.parallelize.parallelize` does afterwards:
the step (with its contexts, the pipeline schedule, the tensor-parallel self-check, the compile report), batch
sharding, backward, gradient sync, clipping over the whole model, state dicts and checkpoints, and removal of
its hooks. :func:`~lightning_4d.composition.parallelize.parallelize` builds it in the composition's order; this
module is what a training loop calls every step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_4d import _compat as compat, checkpoint
from lightning_4d.composition.plans import Plans
from lightning_4d.context_parallel import ContextParallel, ContextParallelConfig
from lightning_4d.context_parallel.step_check import StepCheck
from lightning_4d.context_parallel.step_metrics import WholeBatchMetrics
from lightning_4d.data_parallel import BucketSets, GradientBuckets, ShardedUnits, gathered
from lightning_4d.memory.compile import Compiled
from lightning_4d.modules.experts import global_balancing_loss
from lightning_4d.modules.multihead_attention import MultiheadForwards
from lightning_4d.numerics import head_loss
from lightning_4d.numerics.clipping import clip_grad_norm_
from lightning_4d.numerics.token_losses import TOKENS_ATTRIBUTE, TokenMeanLosses, TokenWindow
from lightning_4d.parallel_dims import ParallelMesh
from lightning_4d.pipeline import PipelineRunner
from lightning_4d.tensor_parallel import (TensorParallelSelfCheck, armed_self_check, tensor_parallel_context,
                                          unmix_foreach)

_MANUAL = None  # the key of the one set of gradient buckets under manual optimization


class ParallelModel:
    """A module made parallel by :func:`~lightning_4d.composition.parallelize.parallelize`, and everything a
    training loop does with it."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, device: torch.device, plans: Plans,
                 pipeline: Optional[PipelineRunner], self_check: Optional[TensorParallelSelfCheck],
                 options: dict[str, Any]) -> None:
        self.module, self.mesh, self.device, self.plans, self.pipeline = module, mesh, device, plans, pipeline
        self.options = options
        self.tensor_plan = plans.tensor if plans.tensor is not None and plans.tensor.enabled else None
        self.context: Optional[ContextParallel] = None
        self.step_check: Optional[StepCheck] = None  # under cp: the first batches' steps run sharded and whole
        self._multihead: Optional[MultiheadForwards] = None  # under cp: forwards of torch's nn.MultiheadAttention
        self.checkpointed_blocks: list[int] = []  # positions in the whole model's block list
        self.compiled: Optional[Compiled] = None  # set when compile is on
        self.eager_reason: Optional[str] = None  # why compile=True left the blocks eager in this layout
        self._self_check = self_check
        self._buckets: dict[Optional[int], GradientBuckets] = {}  # by id(optimizer); _MANUAL: all optimizers'
        self._optimizers: list[Optimizer] = []
        self._armed: Optional[GradientBuckets] = None
        self._sync_blocked = False  # inside block_sync(): manual backwards accumulate this rank's gradients only
        self._unsynchronized = False  # the gradients hold a blocked manual backward's, not synchronized since
        self.sharded: Optional[ShardedUnits] = None  # the FSDP units when dp_shard > 1
        self.own_sharded: set[int] = set()  # ids of parameters in FSDP units the module's configure_model made
        self.replicated_params: list[nn.Parameter] = []  # kept out of FSDP: reduced by the gradient buckets
        self.expert_params: list[nn.Parameter] = []  # split over ep: reduced over the ep replicas only
        self.expert_dispatch: list[Any] = []  # expert parallelism's dispatchers (their traffic counters)
        self.frozen: frozenset[str] = frozenset()  # parameters with requires_grad=False when parallelized
        # Where each frozen parameter this rank holds lives (name, its owner's parameter dict, its name there), found
        # at the first training step, once the layout replaced what it replaces: the per-step check reads these.
        self._frozen_slots: Optional[list[tuple[str, dict[str, Any], str]]] = None
        dims = mesh.dims
        # torchmetrics sync over the ranks that saw different data: replicas and cp ranks (each saw its part of
        # every sequence). Under pipelining only the last stage updates metrics, the others keep default states
        # (zeros, empty lists), so the sync also spans the stages and gives every rank the last stage's values.
        self.metric_group = mesh.group("pp_dp_cp" if dims.pp_enabled else "dp_cp")
        self.pp_group = mesh.group("pp") if dims.pp_enabled else None
        # Token-mean losses count every valid target of the batch once: summed over the ranks that split it.
        splits_batch = dims.dp * dims.dp_shard * dims.cp > 1
        self.token_group = mesh.group("dp_cp") if splits_batch else None
        # transformers' MoE load-balancing loss over the global batch, as one process computes it
        owners = compat.hf_balancing_loss_modules(module) if splits_batch else []
        self._balancing = (owners, global_balancing_loss(self.token_group)) if owners else None
        self.token_losses = options["loss_normalization"] in ("tokens", "batch")
        # "tokens": over a whole accumulation window; "batch": each batch's mean, the window's averaged (Lightning's)
        self.window = TokenWindow() if options["loss_normalization"] == "tokens" else None
        self.head_loss: Optional[head_loss.ChunkedHeadLoss] = None  # the LM head fused with its cross entropy

    @property
    def gradient_bucket_counts(self) -> list[int]:
        """Each optimizer's data-parallel all-reduce buckets, counted (empty before the first step)."""
        return [len(buckets.buckets) for buckets in self._buckets.values()]

    def describe(self) -> str:
        """The plans, and under sharding the parameters this rank keeps replicated (printed by rank 0)."""
        lines = [self.plans.describe()] if self.plans.describe() else []
        if self.replicated_params:
            names = {id(p): name for name, p in self.module.named_parameters()}
            lines.append(f"dp_shard={self.mesh.dims.dp_shard}: kept replicated on rank {dist.get_rank()}, all-reduced"
                         " over dp x cp: " + ", ".join(names[id(p)] for p in self.replicated_params if id(p) in names))
        return "\n".join(lines)

    # ----------------------------------------------------------------------------------- hooks

    def install_hooks(self) -> None:
        """Context-parallel hooks and forwards on the module (again, after :meth:`remove`)."""
        dims = self.mesh.dims
        if dims.cp_enabled and self.context is None:
            # Sequence parallelism splits each cp shard again over the tp ranks.
            sp = dims.tp if self.tensor_plan is not None and self.tensor_plan.sequence_parallel else 1
            config: ContextParallelConfig = self.options["context"]
            self.context = ContextParallel(self.module, self.mesh.group("cp"), comm=config.comm, seq_dim=config.seq_dim,
                                           batch_keys=config.batch_keys, position_modules=config.position_modules,
                                           buffers=config.buffers, sequence_parallel=sp,
                                           document_key=config.document_key,
                                           tensor_parallel=dims.tp if self.tensor_plan is not None else 1)
            if self.pipeline is not None:  # a micro-batch's masks read its rows of the step's padding and documents
                self.pipeline.before_microbatch = self.context.select_rows
            else:  # torchmetrics logged per step: the whole batch's value (the pipeline's runner gives it there)
                self.context.around_step = WholeBatchMetrics(self.module, self.mesh.group("cp")).running
            if config.check:
                sixteen = (torch.bfloat16, torch.float16)
                low = self.options["param_dtype"] in sixteen or any(p.dtype in sixteen for p in self.module.parameters())
                self.step_check = StepCheck(self.context, self.module, self.device, config.check_tokens, low)
        if dims.cp_enabled and self._multihead is None:
            # torch's nn.MultiheadAttention computes attention out of the interception's reach: lightning_4d's
            # forward on each instance (tensor parallelism gave the ones it shards theirs already, for good).
            self._multihead = MultiheadForwards(self.module.modules())

    def remove(self) -> None:
        """Take off the hooks that only serve training: gradient buckets, context-parallel hooks and the forward
        of torch's nn.MultiheadAttention that context parallelism set. (The cut and the shards stay: they are
        the module now.) The pipeline's last results finish sending."""
        if self.pipeline is not None:
            self.pipeline.finish_sending()
        for buckets in self._buckets.values():
            buckets.remove()
        self._buckets.clear()
        if self.context is not None:
            self.context.remove()
            self.context = self.step_check = None
        if self._multihead is not None:
            self._multihead.remove()
            self._multihead = None

    # ------------------------------------------------------------------------------------ steps

    def shard_batch(self, batch: Any, step: Optional[str] = None, host: Any = None) -> Any:
        """This rank's part of the batch: under context parallelism, its shard of every sequence (kept whole too
        when ``step``, the step method it is for, has its first batch checked). ``host``: the batch before it
        went to the device, when it holds the same values (the masks' decisions are taken on it). Prediction
        (``"predict_step"``) runs on whole sequences: its outputs are per token or per sequence."""
        if self.context is None or step == "predict_step":
            return batch
        return self.context.shard_batch(batch, keep_whole=self.step_check is not None and self.step_check.due(step),
                                        host=host)

    @contextmanager
    def step_context(self, predicting: bool = False) -> Iterator[None]:
        """What every step runs inside: tensor parallelism's loss-parallel cross entropy, then context-parallel
        attention and positions (not for prediction, which runs on whole sequences)."""
        with ExitStack() as stack:
            if self.tensor_plan is not None:
                stack.enter_context(tensor_parallel_context(self.tensor_plan))
            if self.context is not None and not predicting:
                stack.enter_context(self.context.step_context())
            if self._balancing is not None:
                stack.enter_context(compat.module_function_replaced(self._balancing[0], "load_balancing_loss_func",
                                                                    self._balancing[1]))
            yield

    def unsharded(self) -> AbstractContextManager[None]:
        """Every FSDP unit's parameters gathered (tensor-parallel shards stay), for code that runs blocks outside
        a step: the tensor-parallel self-check."""
        return gathered(self.module) if self.sharded is not None else nullcontext()

    def recompute_context(self) -> AbstractContextManager[None]:
        """Around a checkpointed block's recomputation during backward."""
        return self.context.recompute_context() if self.context is not None else nullcontext()

    def step(self, name: str, args: tuple, kwargs: dict, *, predicting: bool = False,
             accumulate_grad_batches: int = 1, gradients_zeroed: bool = False) -> Any:
        """Run the module's step method ``name`` (``training_step``, ``validation_step``, ...) as one process
        would on the whole batch; under pipelining the schedule runs the backward passes here too.
        ``gradients_zeroed``: the training loop zeroes the optimizers' gradients after this step, before its
        backward (Lightning's automatic optimization, on the first batch of an accumulation window); they are
        freed before the step instead, which gives the same gradients without holding the previous ones through
        the forward (and, under pipelining, through the whole schedule)."""
        with head_loss.step_scope(self.head_loss, deferred=not predicting):
            return self._step(name, args, kwargs, predicting, accumulate_grad_batches, gradients_zeroed)

    def _step(self, name: str, args: tuple, kwargs: dict, predicting: bool, accumulate_grad_batches: int,
              gradients_zeroed: bool) -> Any:
        training = name == "training_step"
        if self.step_check is not None and not predicting and self.step_check.due(name):
            self.step_check.check(name, self._step_without_gradients(name, args, kwargs))
        if training:
            self._check_still_frozen()
            if gradients_zeroed:
                for param in (p for optimizer in self._optimizers for g in optimizer.param_groups for p in g["params"]):
                    param.grad = None
        check, self._self_check = (self._self_check, None) if training else (None, self._self_check)
        with ExitStack() as stack:
            if check is not None:
                stack.enter_context(armed_self_check(check, self.unsharded))
            stack.enter_context(self.step_context(predicting))
            window = self.window if training and accumulate_grad_batches > 1 else None
            token_losses = self._token_losses(self.pipeline is not None, window is not None) if not predicting else None
            if self.pipeline is not None:
                around = self.sharded.pipelined_step if self.sharded is not None else (lambda _: nullcontext())
                output = self.pipeline.step(name, args, kwargs, accumulate_grad_batches, around, token_losses)
            else:
                if token_losses is not None:  # validation and test losses are logged like training's
                    stack.enter_context(token_losses)
                output = getattr(self.module, name)(*args, **kwargs)
            output = head_loss.materialized(output)  # logits returned from the step leave it computed
        loss = output.get("loss") if isinstance(output, dict) else output
        if window is not None:
            count = self.pipeline.token_count if self.pipeline is not None else None
            window.take(loss, token_losses, accumulate_grad_batches, count)
        if training and self.context is not None and getattr(loss, TOKENS_ATTRIBUTE, None) is None:
            output = self.context.global_loss(output)  # a token-mean loss is the whole batch's already
        if training and self.compiled is not None and not self.compiled.reported:
            self.compiled.report()  # after the first training step, once dynamo has met every graph break
        return output

    def _step_without_gradients(self, name: str, args: tuple, kwargs: dict) -> Callable[[Any, bool], Any]:
        """For the step check: the step ``name`` on another batch, forward only, returning what :meth:`step`
        returns; ``sharded``: on a shard, with its token losses, logs and loss combined over the cp group only
        (one replica's sample, like the whole run), else as one process on the whole sample. Token-mean losses
        are weighed as one process weighs them whatever ``loss_normalization`` says: the check is about what the
        step computes from its tokens, and ``"replica"`` (each shard's own mean) is a weighting chosen on purpose."""
        def run(batch: Any, sharded: bool) -> Any:
            call_args = (batch, *args[1:])
            group = self.mesh.group("cp") if sharded else None
            token_losses = TokenMeanLosses(group)
            with ExitStack() as stack:
                if self.tensor_plan is not None:
                    stack.enter_context(tensor_parallel_context(self.tensor_plan))
                if sharded:
                    stack.enter_context(self.context.context())
                    if self._balancing is not None:
                        stack.enter_context(compat.module_function_replaced(
                            self._balancing[0], "load_balancing_loss_func", global_balancing_loss(group)))
                if self.pipeline is not None:
                    around = self.sharded.pipelined_step if self.sharded is not None else (lambda _: nullcontext())
                    output = self.pipeline.step(name, call_args, kwargs, around=around, token_losses=token_losses,
                                                forward_only=True)
                else:
                    stack.enter_context(token_losses)
                    output = getattr(self.module, name)(*call_args, **kwargs)
                output = head_loss.materialized(output)
            loss = output.get("loss") if isinstance(output, dict) else output
            if sharded and name == "training_step" and getattr(loss, TOKENS_ATTRIBUTE, None) is None:
                output = self.context.global_loss(output)
            return output

        return run

    def _token_losses(self, deferred: bool, window: bool) -> Optional[TokenMeanLosses]:
        return TokenMeanLosses(self.token_group, deferred, window) if self.token_losses else None

    @property
    def manual(self) -> bool:
        """The module optimizes manually (``automatic_optimization = False``): every ``manual_backward`` may be
        the last before a step, so each synchronizes unless inside :meth:`block_sync`."""
        return not getattr(self.module, "automatic_optimization", True)

    def _check_still_frozen(self) -> None:
        """Refuse, before any collective of the step, a parameter frozen at set-up that trains now: tensor
        parallelism's gradient hooks, the gradient buckets and FSDP's reduction were set up without it."""
        if self._frozen_slots is None:
            owners = dict(self.module.named_modules())
            self._frozen_slots = [(name, compat.parameters_of(owners[name.rpartition(".")[0]]), name.rpartition(".")[2])
                                  for name, _ in self.module.named_parameters() if name in self.frozen]
        thawed = [name for name, params, local in self._frozen_slots
                  if (p := params.get(local)) is not None and p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"{', '.join(thawed[:3])}{' ...' if len(thawed) > 3 else ''} had requires_grad=False when"
                f" FourDStrategy set up {type(self.module).__name__} and requires grad now: its gradient would miss"
                " the reductions set up for the trainable parameters, and the layout would train another model than"
                " one process. Fix: choose what trains before fit starts (in __init__ or configure_model); to train"
                " it in a later phase, run that phase as another fit of a freshly built module loaded from the"
                " checkpoint.")

    def backward(self, run_backward: Callable[[], None]) -> None:
        """Lightning's backward: ``run_backward`` computes the gradients (already computed by the pipeline
        schedule, which only commits them here); the armed buckets then finish the gradient sync, so that
        ``on_after_backward`` sees averaged gradients, as with DDP. Under manual optimization the gradients are
        synchronized when this returns, as one process would have them for clipping, logging and the step."""
        if self.pipeline is not None:
            self.pipeline.commit_gradients()
        else:
            with ExitStack() as stack:
                if self.tensor_plan is not None:
                    stack.enter_context(tensor_parallel_context(self.tensor_plan))
                if self.manual:
                    stack.enter_context(self._manual_backward_sync())
                run_backward()
        if self._armed is not None:
            self._armed.synchronize()

    @contextmanager
    def _manual_backward_sync(self) -> Iterator[None]:
        """Around a ``manual_backward``: the buckets all-reduce during backward and FSDP reduce-scatters, so the
        gradients (everything accumulated since the last step included) are synchronized after it; inside
        :meth:`block_sync` nothing is sent and the gradients stay this rank's until a later backward."""
        if self._sync_blocked:
            self._unsynchronized = True
            yield
            return
        buckets = self._buckets.get(_MANUAL)
        with self.sharded.gradient_sync() if self.sharded is not None else nullcontext():
            if buckets is not None:
                buckets.begin()
            yield
        if buckets is not None:
            buckets.synchronize()
        self._unsynchronized = False

    @contextmanager
    def block_sync(self) -> Iterator[None]:
        """Manual backwards inside accumulate gradients without synchronizing them (the strategy's
        ``block_backward_sync``); the first ``manual_backward`` outside synchronizes all of it. Under automatic
        optimization it changes nothing: only the backward before an optimizer step synchronizes there anyway."""
        blocked, self._sync_blocked = self._sync_blocked, True
        try:
            yield
        finally:
            self._sync_blocked = blocked

    def check_synchronized(self, call: str) -> None:
        """Refuse ``call`` (a clip, an optimizer step) on gradients a blocked manual backward left unsynchronized:
        they would differ from one process's without a word. Local state, the same on every rank that runs the
        same training_step: raised before any collective of ``call``."""
        if self._unsynchronized:
            raise RuntimeError(
                f"{call} after a manual_backward inside block_backward_sync(), with none outside it since: the"
                " gradients are still this rank's own, not synchronized over the data-parallel and context-parallel"
                " ranks, so they would differ from one process's. Run the last manual_backward before each"
                " optimizer step outside the block (it synchronizes everything accumulated), e.g. `with"
                " self.trainer.strategy.block_backward_sync() if accumulating else nullcontext():"
                " self.manual_backward(loss)`.")

    # --------------------------------------------------------------------------------- gradients

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """One set of gradient buckets per optimizer, over the ``dp x cp`` ranks; with sharding only for the
        parameters FSDP does not hold (FSDP reduces its own). Under manual optimization one set for all of them:
        a ``manual_backward`` is tied to no optimizer and may reach the parameters of several."""
        for buckets in self._buckets.values():
            buckets.remove()
        self._optimizers = list(optimizers)
        unmixed = unmix_foreach(self._optimizers)
        if unmixed:
            rank_zero_info(f"foreach=False in {len(unmixed)} optimizer param groups that asked for foreach=True: they"
                           " hold tensor-parallel DTensors and plain tensors, which torch's foreach kernels refuse"
                           " together; the per-tensor update computes the same values.")
        group = self.mesh.group("dp_cp")
        kept = {id(p) for p in self.replicated_params}
        experts = {id(p) for p in self.expert_params}
        own = self.own_sharded  # reduced by the module's own FSDP units
        by_key = {_MANUAL: optimizers} if self.manual else {id(optimizer): [optimizer] for optimizer in optimizers}
        self._buckets = {}
        self._unsynchronized = False
        for key, owners in by_key.items():
            params = [p for optimizer in owners for g in optimizer.param_groups for p in g["params"]
                      if (self.sharded is None or id(p) in kept) and id(p) not in experts and id(p) not in own]
            expert_params = [p for optimizer in owners for g in optimizer.param_groups for p in g["params"]
                             if id(p) in experts]
            sets = []
            if params:
                sets.append(GradientBuckets(params, group, self.options["bucket_mb"]))
            if expert_params:  # each ep rank holds other experts: averaged over the ranks holding the same ones
                sets.append(GradientBuckets(expert_params, self.mesh.group("ep_replica"), self.options["bucket_mb"]))
            if sets:
                self._buckets[key] = sets[0] if len(sets) == 1 else BucketSets(sets)

    def synchronizing(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (training step, zero_grad, backward) with its gradients averaged over the replicas.

        Lightning calls the closure through the optimizer step only for the last micro-step of gradient
        accumulation, so only that backward communicates. Under pipelining the schedule runs a backward per
        micro-batch: the buckets then reduce everything after the step, not during backward.

        Under manual optimization each ``manual_backward`` synchronized already: the step only checks that the
        last one did (see :meth:`check_synchronized`).
        """
        if self.manual:
            def closure_then_check() -> Any:
                result = closure()
                self.check_synchronized("optimizer.step()")
                return result

            return closure_then_check
        buckets = self._buckets.get(id(optimizer))
        if buckets is None and self.sharded is None and self.window is None:
            return closure

        def closure_with_gradient_sync() -> Any:
            with self.sharded.gradient_sync() if self.sharded is not None else nullcontext():
                if buckets is not None:
                    buckets.begin(overlap=self.pipeline is None)
                self._armed = buckets
                try:
                    result = closure()
                finally:
                    self._armed = None
            if buckets is not None:
                buckets.synchronize()
            if self.window is not None:  # the accumulation window's token mean, before Lightning clips
                self.window.finish(self.module.parameters())
            return result

        return closure_with_gradient_sync

    def clip_grad_norm_(self, parameters: Sequence[Tensor], max_norm: float) -> Tensor:
        """Clip by the norm over the whole model: every stage, every shard; a weight kept by the first and the
        last stage counts once."""
        if self.pipeline is not None:
            return clip_grad_norm_(parameters, max_norm, group=self.pp_group,
                                   skip_in_norm=self.pipeline.counted_on_another_stage())
        return clip_grad_norm_(parameters, max_norm)

    # -------------------------------------------------------------------------------- state

    def model_state(self) -> dict[str, Any]:
        """The tensors this rank holds, by full parameter name (DTensor shards stay shards)."""
        return checkpoint.model_state(self.module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return checkpoint.optimizer_state(self.module, optimizer)

    @property
    def whole_model_keys(self) -> Optional[frozenset[str]]:
        """Every state-dict key of the whole model under pipelining (this rank holds its stage's only)."""
        return self.plans.pipeline.state_keys if self.plans.pipeline is not None else None

    def load(self, path: str, optimizers: Sequence[Optimizer], strict: bool = True) -> dict[str, Any]:
        """A lightning-4d checkpoint directory into this layout; returns Lightning's metadata."""
        return checkpoint.load(path, self.module, optimizers, strict=strict, whole_model=self.whole_model_keys)

    def load_weights(self, path: str, strict: bool = True, prefix: Optional[str] = None) -> None:
        """Weights only, each rank reading what it holds: a lightning-4d checkpoint directory, a Hugging Face
        directory, a torch DCP directory, a Lightning checkpoint file or a plain state_dict file (memory-mapped).
        ``prefix``: the module path the file's keys start at (found automatically when None)."""
        checkpoint.load_weights(path, self.module, strict=strict, whole_model=self.whole_model_keys, prefix=prefix)

    def full_state(self) -> dict[str, Tensor]:
        """The whole model as plain tensors on every rank (collective; for export and tests of small models)."""
        return checkpoint.full_model_state(self.module, pp_group=self.pp_group)
