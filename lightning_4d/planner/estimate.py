"""Layout planner: which ``(dp, pp, cp, tp)`` layouts fit a model on a number of devices, and what they cost.

``python -m lightning_4d.plan --devices 8 --memory 80GiB --module lightning_4d.demos.gpt:GPT --seq 2048
--global-batch 16`` ranks every valid layout by estimated communication per step among those whose estimated
peak memory per device fits. The estimate is arithmetic only (no devices, no model weights: ``--module`` is
built on the meta device), so it answers in seconds for any model size.

Memory per device, on the pipeline stage that needs most:

* model state: parameters, gradients and optimizer state of the stage's share of the layers, split by tp
  (1-D norm gains stay whole), plus the vocabulary-parallel embedding on the first stage and the head on the
  last. Bytes per parameter follow Lightning's precisions: ``bf16-mixed`` keeps fp32 parameters (they are the
  master weights) and fp32 gradients; ``bf16-true`` keeps everything, AdamW's two moments included, in bf16.
* gradient buckets: with dp*cp > 1 the data-parallel all-reduce holds a flat copy of the gradients until the
  optimizer step (``lightning_4d.data_parallel``).
* activations, by the accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"), whose ``s*b*h*(34 + 5*a*s/h)`` bytes per layer are the 16-bit tensors a block keeps
  for backward. Written per element, so that any precision and size fits, per ``s*b*h``:
  outside the tensor-parallel regions, each of the two norms keeps its input and output, and, unless it is
  one fused kernel (``nn.LayerNorm``; torch's ``nn.RMSNorm`` on CPU is not), also its normalized input: 4 or
  6 elements, split by tp only under sequence parallelism (whose regions still keep the gathered input
  whole); inside them q, k and v (``1 + 2*kv_heads/heads``), the attention output, which is the output
  projection's input (1), and the MLP's inner activation before and after the nonlinearity
  (``2*ffn/h``; a gated MLP keeps gate, activation, up and product: ``4*ffn/h``), split by tp. Without a fused attention kernel the ``a*s*s*b`` softmax is kept too (with
  dropout also its mask and dropped-out copy: the paper's ``5*a*s/h``), and dropout adds one-byte masks.
  Context parallelism divides ``s`` by cp. Stage ``i`` of ``pp`` holds ``min(pp - i, m)`` micro-batches
  under 1F1B (all ``m`` under GPipe), each of ``b = global_batch / dp / m`` samples (``m`` defaults to
  ``2*pp``, as ``FourDStrategy(pp_microbatches=None)``). The last stage adds the final norm and the LM
  head's logits (``logits``): unfused, the logits and their fp32 log-softmax, tokens x vocab / tp each; fused
  (``FourDStrategy(fuse_lm_loss=True)``, :mod:`lightning_4d.numerics.head_loss`), one chunk's logits, fp32
  softmax and gradient (a chunk holds as many logits as the head's input has elements, at least 2^22), plus
  the gradients formed in forward and kept for backward: the head's input rows' and its weight's (its share
  under tp); under GPipe and looped BFS, whose last stage holds every micro-batch, the head forms them in
  backward instead, so none are kept, and a head without tp whose logits, all micro-batches' together, fit
  in one chunk runs unfused there. With ``activation_checkpointing`` a checkpointed block keeps only its input
  (``"selective"``: its input and its matmuls' outputs), the stage's checkpointed blocks are all of them
  (``"full"``, ``"selective"``) or ``layers // n`` (``"every_n"``), and backward adds one block's full
  activations while it recomputes it.
* the peak: the previous step's gradients live until ``zero_grad``, which Lightning calls after the forward,
  so the forward's activations meet a full set of gradients; under pipeline parallelism the schedule
  computes fresh gradients inside the forward while those are set aside, so two sets meet the activations.
  The gradient buckets peak at the end of the backward, when activations are gone.
  Peak = state + max(activations (+ gradients under pp), buckets).

Setup memory per device, before the first step, for the two ways a model is built (``BUILDS``):

* ``whole``: every rank builds the whole model (in the parameters' dtype), and rank 0's weights reach the others
  in buckets of at most ``BROADCAST_BUCKET_BYTES``; the rank's share is then cut from the whole copy tensor by
  tensor. Peak = the model's bytes + one bucket.
* ``meta``: built on the meta device (``trainer.init_module(empty_init=True)``, or ``init_from``): each rank
  allocates only its share (as the training estimate's parameters) and fills it, by its initializer or by
  reading, one tensor at a time. Peak = the share + the largest tensor (whole: a replicated tensor is read
  whole, and a bound for the slice of a sharded one).

Neither counts gradients or optimizer state (created at the first step) or activations.

Communication per step is what one device sends, with ring collectives (an all-reduce of ``S`` bytes over
``n`` ranks sends ``2(n-1)/n*S``): the gradient all-reduce over dp*cp; four activation all-reduces per layer
and micro-batch over tp (forward and backward; all-gather/reduce-scatter pairs under sequence parallelism send
the same); the ring's K/V blocks over cp (forward, and K/V plus their gradients in backward); and stage
boundaries' activations and gradients over pp.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_4d.planner.model_sizes import Model, PlanError, check_positive, divisors


AC_MODES = ("none", "full", "every_n", "selective")  # lightning_4d.memory.activation_checkpointing.MODES
MIN_CHUNK_ELEMENTS = 1 << 22  # lightning_4d.numerics.head_loss.MIN_CHUNK_ELEMENTS
# Bytes per element: (parameters, gradients, activations).
PRECISIONS = {
    "32-true": (4, 4, 4),
    "bf16-mixed": (4, 4, 2),
    "16-mixed": (4, 4, 2),
    "bf16-true": (2, 2, 2),
    "16-true": (2, 2, 2),
}
# Optimizer state per parameter, in units of the parameter's own size.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
# The names of lightning_4d.pipeline.config.SCHEDULES (tests/test_layout_agreement.py keeps them equal), written
# out so that importing the planner (and its --help) needs no torch.
# How the model is built, for the setup peak: whole on every rank, or on the meta device (also init_from).
BUILDS = ("whole", "meta")
# lightning_4d.composition.weight_agreement.BROADCAST_BUCKET_BYTES (tests/test_plan.py keeps them equal), written out for the same
# reason: the most bytes beyond the model that agreeing on a whole-built model's weights copies at once.
BROADCAST_BUCKET_BYTES = 64 * 2**20
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                "dualpipev")
# Those whose stages run every micro-batch's forward before the first backward (``ScheduleSpec.forwards_first``).
FORWARDS_FIRST = ("gpipe", "looped_bfs")


@dataclass(frozen=True)
class Training:
    """What one optimizer step processes and how."""

    seq_len: int
    global_batch: int  # samples per optimizer step, all replicas together
    precision: str = "32-true"
    optimizer: str = "adamw"
    microbatches: Optional[int] = None  # pipeline micro-batches per step; default: 2 * pp
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = False
    fused_attention: bool = True  # flash/memory-efficient SDPA kernels: no s*s score matrix is kept
    fused_norm: bool = False  # one-kernel norms (nn.LayerNorm) keep no normalized copy of their input
    dropout: bool = False
    activation_checkpointing: str = "none"  # as FourDStrategy(activation_checkpointing=...)
    activation_checkpointing_every: int = 2
    fuse_lm_loss: bool = True  # as FourDStrategy(fuse_lm_loss=...): the LM head's logits never whole
    synced_logs: int = 1  # values the training step logs with sync_dist=True (the loss, usually)

    def __post_init__(self) -> None:
        check_positive("seq_len", self.seq_len)
        check_positive("global_batch", self.global_batch)
        check_positive("activation_checkpointing_every", self.activation_checkpointing_every)
        if self.activation_checkpointing not in AC_MODES:
            raise PlanError(f"activation_checkpointing={self.activation_checkpointing!r} is not one of"
                            f" {', '.join(AC_MODES)}.")
        if self.microbatches is not None:
            check_positive("microbatches", self.microbatches)
        if self.synced_logs < 0:
            raise PlanError(f"synced_logs={self.synced_logs!r} must be 0 or more.")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}.")
        if self.pp_schedule not in PP_SCHEDULES:
            raise PlanError(f"pp_schedule={self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}.")
        if self.optimizer not in OPTIMIZER_STATES:
            raise PlanError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}.")


@dataclass(frozen=True)
class Layout:
    """Sizes as ``FourDStrategy`` takes them: ``dp`` replicas, each sharded over ``dp_shard`` ranks (FSDP2)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    dp_shard: int = 1

    @property
    def devices(self) -> int:
        return self.data_parallel * self.pp * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: replicas times shards."""
        return self.dp * self.dp_shard

    def __str__(self) -> str:
        shard = f" dp_shard={self.dp_shard}" if self.dp_shard > 1 else ""
        return f"dp={self.dp}{shard} pp={self.pp} cp={self.cp} tp={self.tp}"


@dataclass
class Estimate:
    """One layout's costs: its training peak by kind, the bytes it sends by dim, and its setup peak by build, so
    that a layout which trains in the memory but cannot build its model there is not recommended."""

    layout: Layout
    memory: dict[str, float]  # bytes per device on the heaviest stage, by kind, and "total"
    comm: dict[str, float]  # bytes one device sends per step, by dim, and "total"
    fits: Optional[bool] = None  # training and the chosen build's setup both fit (None: no memory given)
    setup: dict[str, float] = field(default_factory=dict)  # setup peak bytes per device, by build (BUILDS)
    build: str = "whole"  # the build whose setup peak ``fits`` counts
    exceeds: tuple[str, ...] = ()  # the peaks above the memory per device: "training", "setup"
    step: Optional[Any] = None  # the predicted step (:class:`.step_time.StepTime`) when a machine is given
    training: Optional[Training] = None  # what the estimate is for (the planner's choice of checkpointing and m)

    @property
    def setup_peak(self) -> float:
        """Bytes per device while the model is built and laid out, for the chosen build."""
        return self.setup[self.build]

    def as_dict(self) -> dict[str, Any]:
        return {"layout": asdict(self.layout), "memory_bytes": self.memory, "comm_bytes": self.comm,
                "setup_bytes": self.setup, "build": self.build, "fits": self.fits, "exceeds": list(self.exceeds),
                **({"step_seconds": self.step.parts, "bubble": self.step.bubble,
                    "activation_checkpointing": self.training.activation_checkpointing,
                    "microbatches": self.training.microbatches} if self.step else {})}


# ------------------------------------------------------------------------------------------- checks


def _microbatches(training: Training, layout: Layout) -> int:
    if layout.pp == 1:
        return 1
    return training.microbatches or 2 * layout.pp


def layout_problems(model: Model, training: Training, layout: Layout) -> list[str]:
    """Why ``layout`` cannot run this model and batch (empty when it can), by the runtime's own rules: the
    typed tensor-, context- and pipeline-parallel configs and the pipeline's block check."""
    from lightning_4d.context_parallel.config import ContextParallelConfig
    from lightning_4d.pipeline.config import PipelineConfig
    from lightning_4d.pipeline.plan import check_blocks
    from lightning_4d.tensor_parallel.config import TensorParallelConfig

    problems = []
    for name, size in (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn_hidden", model.ffn_hidden),
                       ("vocab", model.vocab)):
        if name == "kv_heads" and size < layout.tp and layout.tp % size == 0:
            continue  # fewer key/value heads than ranks: k and v stay whole on every rank (_replicated_kv)
        if size % layout.tp:
            problems.append(f"tp={layout.tp} does not divide {name} ({size})")
    tensor_parallel = TensorParallelConfig(layout.tp, sequence_parallel=training.sequence_parallel)
    pipeline, schedule_problem = None, None
    if layout.pp > 1:
        try:
            pipeline = PipelineConfig(layout.pp, training.pp_schedule, training.microbatches)
        except ValueError as error:  # micro-batches that do not fit the schedule
            schedule_problem = str(error).rstrip(".")
            pipeline = PipelineConfig(layout.pp, training.pp_schedule)
        try:
            check_blocks([object() for _ in range(model.layers)], "the blocks", pipeline)
        except ValueError:
            per_rank = f" x {pipeline.stages_per_rank} stages per rank" if pipeline.stages_per_rank > 1 else ""
            problems.append(f"pp={layout.pp}{per_rank} exceeds the {model.layers} layers")
        try:
            tensor_parallel.check_with_pipeline(layout.pp)
        except ValueError:
            problems.append(f"sequence_parallel does not work with pp={layout.pp}: a stage boundary carries a"
                            " plain tensor")
    if layout.cp > 1:
        context_parallel = ContextParallelConfig(layout.cp)
        try:
            context_parallel.check_sequence_length(training.seq_len, tensor_parallel.sequence_shards)
        except ValueError:
            rule = "2*cp*tp" if tensor_parallel.sequence_shards > 1 else "2*cp"
            problems.append(f"cp={layout.cp} needs the sequence ({training.seq_len}) divisible by {rule}="
                            f"{context_parallel.sequence_multiple(tensor_parallel.sequence_shards)}")
    m = _microbatches(training, layout)
    if training.global_batch % layout.data_parallel:
        data = f"dp={layout.dp}" if layout.dp_shard == 1 else f"dp*dp_shard={layout.data_parallel}"
        problems.append(f"{data} does not divide the global batch ({training.global_batch})")
    elif layout.pp > 1 and (training.global_batch // layout.data_parallel) % m:
        problems.append(f"the batch per replica ({training.global_batch // layout.data_parallel}) does not divide into"
                        f" {m} pipeline micro-batches")
    if schedule_problem:
        problems.append(schedule_problem)
    return problems


def all_layouts(devices: int, shard: bool = True) -> list[Layout]:
    """Every ``(dp, pp, cp, tp)`` whose product is ``devices``; with ``shard``, each also with its data-parallel
    ranks split into ``dp`` replicas of ``dp_shard`` shards in every way."""
    check_positive("devices", devices)
    return [Layout(data // dp_shard, pp, cp, devices // (data * pp * cp), dp_shard)
            for data in divisors(devices) for pp in divisors(devices // data)
            for cp in divisors(devices // (data * pp)) for dp_shard in (divisors(data) if shard else [1])]


# ------------------------------------------------------------------------------------------ estimates


def _stage_layers(layers: int, pp: int, schedule: str = "1f1b") -> list[int]:
    """Blocks per pipeline rank (all its stages together), split as ``FourDStrategy(pp=pp, pp_schedule=...)``
    splits them."""
    from lightning_4d.pipeline.config import PipelineConfig

    config = PipelineConfig(pp, schedule)
    per_rank = [0] * pp
    for rank, (start, stop) in zip(config.stage_ranks(), config.stage_bounds(layers)):
        per_rank[rank] += stop - start
    return per_rank


def _tokens(training: Training, layout: Layout) -> float:
    """Tokens of one micro-batch on one device."""
    return training.seq_len / layout.cp * training.global_batch / layout.data_parallel / _microbatches(training, layout)


def _replicated_kv(model: Model, tp: int, held: bool = False) -> int:
    """Per block, the k and v weights tensor parallelism leaves unsharded when tp exceeds the key/value heads
    (each rank then uses one key/value head). ``held``: what a rank holds of them, all of separate k and v
    projections, of a fused q|k|v projection the rows of the one key/value head it reads."""
    heads = 1 if held and model.fused_qkv else model.kv_heads
    return 2 * model.hidden * heads * (model.hidden // model.heads) if model.kv_heads < tp else 0


def _stage_params(model: Model, layout: Layout, stage: int, layers: int) -> float:
    tp, last = layout.tp, layout.pp - 1
    kv, held = _replicated_kv(model, tp), _replicated_kv(model, tp, held=True)
    params = layers * ((model.layer_matrix_params - kv) / tp + held + model.layer_vector_params)
    if stage == 0:
        params += model.embedding_params / tp
    if stage == last:
        # A tied head on its own stage is a second copy of the embedding.
        head = model.embedding_params if model.tied and layout.pp > 1 else model.head_params
        params += head / tp + model.other_params
    return params


def _block_share(model: Model, layout: Layout, layers: int) -> float:
    """The blocks' part of a pp=1 rank's parameters."""
    block = model.layer_matrix_params / layout.tp + model.layer_vector_params
    return layers * block / _stage_params(model, layout, 0, layers)


def _norm_elements(training: Training) -> int:
    return 2 if training.fused_norm else 3


def activation_bytes_per_layer(model: Model, training: Training, layout: Layout) -> float:
    """Bytes one block keeps for backward for one micro-batch on one device."""
    e = PRECISIONS[training.precision][2]
    h, tp = model.hidden, layout.tp
    local_seq = training.seq_len / layout.cp
    tokens = _tokens(training, layout)
    masks = 2 if training.dropout else 0  # after attention and after the MLP, one byte per element
    norms = 2 * _norm_elements(training) * e
    if training.sequence_parallel:
        # The norms run on sequence shards; each region keeps its gathered input (the norm's output) whole.
        outside = (norms - 2 * e + masks) / tp + 2 * e
    else:
        outside = norms + masks
    mlp = (4 if model.gated_mlp else 2) * model.ffn_hidden / h  # gated: gate, its activation, up, product
    inside = (1 + 2 * model.kv_heads / model.heads + 1 + mlp) * e / tp
    per_token = h * (outside + inside)
    if not training.fused_attention:
        # the softmax over local_seq keys per head; with dropout also its mask and the dropped-out copy
        per_token += model.heads * local_seq * (e + (1 + e if training.dropout else 0)) / tp
    return tokens * per_token


def kept_bytes_per_layer(model: Model, training: Training, layout: Layout) -> tuple[float, float]:
    """Bytes a block keeps for backward under the training's activation checkpointing, for one micro-batch:
    ``(checkpointed block, other block)``. A checkpointed block keeps its input; "selective" keeps its
    input and its matmuls' outputs (q, k, v, the output projection's, the MLP's up/gate and down)."""
    full = activation_bytes_per_layer(model, training, layout)
    e, h, tp = PRECISIONS[training.precision][2], model.hidden, layout.tp
    outside = 1 / tp if training.sequence_parallel else 1  # a block's input and its row-parallel outputs
    mode = training.activation_checkpointing
    if mode == "selective":
        inside = (1 + 2 * model.kv_heads / model.heads + (2 if model.gated_mlp else 1) * model.ffn_hidden / h) / tp
        return _tokens(training, layout) * h * e * (3 * outside + inside), full
    return (_tokens(training, layout) * h * e * outside if mode != "none" else full), full


def _checkpointed(training: Training, layers: int) -> int:
    mode = training.activation_checkpointing
    return {"none": 0, "full": layers, "selective": layers}.get(mode, layers // training.activation_checkpointing_every)


def estimate(model: Model, training: Training, layout: Layout) -> Estimate:
    """Peak memory per device (heaviest pipeline stage) and bytes sent per device per step."""
    pbytes, gbytes, e = PRECISIONS[training.precision]
    obytes = OPTIMIZER_STATES[training.optimizer] * pbytes
    m = _microbatches(training, layout)
    tokens = _tokens(training, layout)
    kept, per_layer = kept_bytes_per_layer(model, training, layout)
    stage_layers = _stage_layers(model.layers, layout.pp, training.pp_schedule)
    heaviest: Optional[tuple[dict[str, float], float]] = None
    largest_share = 0.0
    for stage, layers in enumerate(stage_layers):
        params = _stage_params(model, layout, stage, layers)
        # GPipe and looped BFS run every forward first; the others start backward after a warm-up.
        in_flight = m if training.pp_schedule in FORWARDS_FIRST else min(layout.pp - stage, m)
        checkpointed = _checkpointed(training, layers)
        activations = in_flight * (checkpointed * kept + (layers - checkpointed) * per_layer)
        if checkpointed:  # backward recomputes one checkpointed block at a time, which then keeps everything
            activations += per_layer
        if stage == layout.pp - 1:
            final_norm = _norm_elements(training) * tokens * model.hidden * e
            activations += final_norm / (layout.tp if training.sequence_parallel else 1)
        logits = logits_bytes(model, training, layout, gbytes) if stage == layout.pp - 1 else 0.0
        shards = layout.dp_shard * layout.cp if layout.dp_shard > 1 else 1
        memory = {
            "params": params * pbytes / shards,
            "grads": params * gbytes / shards,
            "optimizer": params * obytes / shards,
            "pipeline_grads": params * gbytes / shards if layout.pp > 1 else 0.0,
            "grad_buckets": params * gbytes if layout.dp * layout.cp > 1 and shards == 1 else 0.0,
            "gathered": _gathered(model, layout, stage, layers, e) if shards > 1 else 0.0,
            "activations": activations,
            "logits": logits,
        }
        memory["total"] = (memory["params"] + memory["grads"] + memory["optimizer"] + memory["gathered"]
                           + max(memory["activations"] + memory["logits"] + memory["pipeline_grads"],
                                 memory["grad_buckets"]))
        largest_share = max(largest_share, memory["params"])
        if heaviest is None or memory["total"] > heaviest[0]["total"]:
            heaviest = (memory, params)
    memory, params = heaviest
    return Estimate(layout, memory, _communication(model, training, layout, params * gbytes, max(stage_layers)),
                    setup=_setup_bytes(model, training, largest_share))


def logits_bytes(model: Model, training: Training, layout: Layout, gbytes: float,
                 fused: Optional[bool] = None) -> float:
    """What the LM head's logits need on the last stage, per device, for one micro-batch (see the module
    docstring); ``fused``: as ``training.fuse_lm_loss`` unless given."""
    e = PRECISIONS[training.precision][2]
    tokens = _tokens(training, layout)
    vocab = model.vocab / layout.tp
    if not (training.fuse_lm_loss if fused is None else fused):
        return tokens * vocab * (e + 4)  # the logits and their fp32 log-softmax
    chunk = min(tokens * vocab, max(MIN_CHUNK_ELEMENTS, tokens * model.hidden))  # logits per chunk
    if layout.pp > 1 and training.pp_schedule in FORWARDS_FIRST:
        if layout.tp == 1 and tokens * vocab * _microbatches(training, layout) <= MIN_CHUNK_ELEMENTS:
            return tokens * vocab * (e + 4)  # every micro-batch's logits fit in a chunk: the head runs unfused
        return chunk * (e + 4 + 4)  # the gradients are formed in backward: none kept from the forward
    return chunk * (e + 4 + 4) + tokens * model.hidden * e + model.vocab * model.hidden / layout.tp * gbytes


def _setup_bytes(model: Model, training: Training, share: float) -> dict[str, float]:
    """Peak bytes per device while the model is built and laid out, by build (see the module docstring): the
    whole model and one broadcast bucket, or the rank's ``share`` (parameter bytes of its heaviest stage) and
    the largest tensor being filled."""
    pbytes = PRECISIONS[training.precision][0]
    whole = model.params * pbytes
    return {"whole": whole + min(BROADCAST_BUCKET_BYTES, whole), "meta": share + model.largest_tensor * pbytes}


def _gathered(model: Model, layout: Layout, stage: int, layers: int, e: int) -> float:
    """Sharded data parallelism's unsharded copies (in the compute dtype, ``e`` bytes) beside the shards: without
    pp, the modules around the blocks (the root unit, gathered for the whole step) and two blocks (the one
    running and the one prefetched), weights and their unsharded gradients before the reduce-scatter; under pp
    the stage's whole share, weights and gradients, gathered for the whole pipeline step."""
    block = model.layer_matrix_params / layout.tp + model.layer_vector_params
    if layout.pp > 1:
        return 2 * _stage_params(model, layout, stage, layers) * e
    around = _stage_params(model, layout, stage, layers) - layers * block
    return (around + 2 * min(2, layers) * block) * e


CP_COMMS = ("ring", "allgather", "a2a")


def cp_exchanges(model: Model, training: Training, layout: Layout) -> dict[str, float]:
    """Bytes one device sends per attention layer and micro-batch for each context-parallel exchange (forward
    and backward; ``a2a`` only where cp divides the heads and key/value heads left by tp):

    * ring: every other rank's K/V block passes through it once forward and once backward, and the dK/dV
      partial sums once: ``3 (cp - 1)`` K/V blocks;
    * allgather: the same bytes as one all-gather forward, one backward and a reduce-scatter of dK/dV (fewer,
      larger messages; all K/V held at once);
    * a2a (Ulysses): ``(cp - 1) / cp`` of q, k, v and the output forward, and of their gradients backward.
    """
    cp, t, e = layout.cp, layout.tp, PRECISIONS[training.precision][2]
    tokens = _tokens(training, layout)
    head_dim = model.hidden // model.heads
    q_block = tokens * model.heads * head_dim / t * e
    kv_block = 2 * tokens * model.kv_heads * head_dim / t * e
    exchanges = {"ring": 3 * (cp - 1) * kv_block, "allgather": 3 * (cp - 1) * kv_block}
    if (model.heads // t) % cp == 0 and (max(model.kv_heads // t, 1)) % cp == 0:
        exchanges["a2a"] = 2 * (cp - 1) / cp * (2 * q_block + kv_block)
    return exchanges


def choose_cp_comm(model: Model, training: Training, layout: Layout) -> str:
    """The exchange the planner recommends: a2a where it sends clearly less (by a quarter or more), else ring,
    which holds only tiles of other ranks' K/V where all-gather holds all of them."""
    exchanges = cp_exchanges(model, training, layout)
    if "a2a" in exchanges and exchanges["a2a"] <= 0.75 * exchanges["ring"]:
        return "a2a"
    return "ring"


def _communication(model: Model, training: Training, layout: Layout, grad_bytes: float,
                   layers: int) -> dict[str, float]:
    e = PRECISIONS[training.precision][2]
    m = _microbatches(training, layout)
    tokens = _tokens(training, layout)
    if layout.dp_shard == 1:
        n = layout.dp * layout.cp
        comm = {"dp": 2 * (n - 1) / n * grad_bytes, "dp_shard": 0.0}
    else:
        # FSDP over dp_shard*cp: each unit's weights all-gathered in forward (and, without pp, again in backward
        # for every block but the last: reshard_after_forward="auto"), gradients reduce-scattered; the replicas
        # all-reduce their shard of the gradients.
        n, replicas = layout.dp_shard * layout.cp, layout.dp
        weights = grad_bytes / PRECISIONS[training.precision][1] * e
        gathers = 1.0 if layout.pp > 1 else 1 + (layers - 1) / layers * _block_share(model, layout, layers)
        comm = {"dp": 2 * (replicas - 1) / replicas * grad_bytes / n,
                "dp_shard": (n - 1) / n * (gathers * weights + grad_bytes)}
    t = layout.tp
    activation = tokens * model.hidden * e
    # Per layer: two forward and two backward all-reduces of the block's output/input gradient.
    comm["tp"] = 4 * 2 * (t - 1) / t * activation * layers * m
    if t > 1:
        comm["tp"] += 2 * (t - 1) / t * activation * m  # the vocabulary-parallel embedding's all-reduce
    comm["cp"] = cp_exchanges(model, training, layout)[choose_cp_comm(model, training, layout)] * layers * m
    boundary = activation / (t if training.sequence_parallel else 1)
    comm["pp"] = (2 if layout.pp > 2 else 1) * m * boundary if layout.pp > 1 else 0.0
    comm["total"] = sum(comm.values())
    return comm


# ------------------------------------------------------------------------------------------ output


def _format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
