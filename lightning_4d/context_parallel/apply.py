"""Context parallelism for an unchanged module: sharded sequences, global positions, ring attention.

The ``cp`` ranks of a context-parallel group receive the same samples and each keeps a zigzag shard of every
sequence (:func:`~lightning_4d.context_parallel.zigzag.zigzag_positions`). The module's own code then runs on
``L / cp`` tokens per sequence, and three things it does would silently mean something else on a shard, so
they are adjusted while a step runs:

* Attention. Every call of scaled-dot-product attention is caught by a ``TorchFunctionMode`` (which sees
  ``F.scaled_dot_product_attention`` under any import name: they are all one function) and computed as ring
  attention over the group. A mask the model built on its shard (padding, a sliding window, packed documents)
  is read for its meaning and applied over the whole sequence (:mod:`.masks`); a mask of another kind is an
  error.
* Positions derived from the local length. ``wpe(torch.arange(T))`` and a rotary embedding's
  ``position_ids`` input are mapped to the tokens' global positions by forward pre-hooks, and tables sliced
  ``buf[:T]`` are swapped for ``buf[global positions]`` for the duration of the step.
* The loss and logged values. Each rank's mean over its tokens averages, over the group, to the mean over
  the whole sequence (the shards are equal), which is the value returned and logged. Gradients need nothing
  here: the data-parallel buckets average them over dp x cp.

Everything except :meth:`ContextParallel.step_context` (which combines ``LightningModule.log`` calls) is
plain torch and works without a Trainer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_4d import _compat as compat
from lightning_4d.context_parallel.batches import _map_tensors, _tensors, evidently_no_sequence, sequence_paths
from lightning_4d.context_parallel.config import ContextParallelConfig, check_sequence_length
from lightning_4d.context_parallel.document_layout import SequenceLayout, balanced_layout, positions_of
from lightning_4d.context_parallel.masks import (AttentionLayer, MaskReadings, SequenceFacts, attention_layer,
                                                 packed_documents, unmasked)
from lightning_4d.context_parallel.positions import _forward_parameters, find_position_buffers, find_position_modules
from lightning_4d.context_parallel.ring_attention import ring_attention
from lightning_4d.context_parallel.sdpa_shapes import sdpa_operands
from lightning_4d.context_parallel.sequence_mask import SequenceMask
from lightning_4d.context_parallel.shifted_labels import shifted_labels, shifts_labels
from lightning_4d.context_parallel.ulysses import check_heads, ulysses_attention
from lightning_4d.numerics.step_logging import StepLogs

_SDPA = F.scaled_dot_product_attention
_RUNNING: list[ContextParallel] = []  # the context-parallel step running on this rank, innermost last
# On an error that comes from the model, not from the step: the step check passes it on as it is.
MODEL_REFUSAL = "_lightning_4d_model_refusal"


class PeerFailed(RuntimeError):
    """Raised on the ranks of a context-parallel group that did not fail when another did (step check)."""

    peer_failure = True  # so marked, an error (or one it was raised from) stands for another rank's


class SequencePositions(NamedTuple):
    positions: Tensor  # the global positions of the tokens this rank holds, in their local order
    length: int  # the whole sequence's length


def sequence_positions(tokens: Tensor, dim: int = 1) -> SequencePositions:
    """The global positions and the whole length of the sequence whose tokens ``tokens`` holds along ``dim``.

    For position-dependent code in a step or a forward (the last ``n`` tokens, a prompt mask, position weights):
    under context parallelism a rank holds a zigzag shard of every sequence, and ``torch.arange(x.size(1))``
    numbers that shard ``0..T/cp-1``. This gives the positions one process would see, on ``tokens``' device,
    under any ``cp`` (and ``0..T-1`` without it, or outside a step), e.g.
    ``positions, length = sequence_positions(x); labels = y.masked_fill(positions < prompt_len, -100)``.
    """
    size = tokens.size(dim)
    running = _RUNNING[-1] if _RUNNING else None
    if running is None:
        return SequencePositions(torch.arange(size, device=tokens.device), size)
    local = running._positions.numel()
    if size != local:
        raise ValueError(f"sequence_positions: dim {dim} of a tensor of shape {tuple(tokens.shape)} has {size} entries,"
                         f" but this rank holds {local} tokens of each sequence (cp={running.size}); pass a tensor"
                         " as the batch gave it (before slicing the sequence), with dim its sequence dim.")
    return SequencePositions(running._positions.to(tokens.device), running._seq_len)



def _sliding_windows(module: nn.Module) -> dict[str, int]:
    """Hugging Face configs with an active sliding window (tried when the attention layer running is unknown)."""
    windows = {}
    for fqn, sub in module.named_modules():
        config = getattr(sub, "config", None)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
        if (isinstance(window, int) and getattr(config, "use_sliding_window", True) is not False
                and any("sliding" in str(kind) for kind in layer_types)):
            windows[f"{fqn or 'the module'} ({type(sub).__name__})"] = window
    return windows


def _check_a2a_heads(module: nn.Module, cp: int, tp: int) -> None:
    """Under ``cp_comm='a2a'``, refuse before any step a Hugging Face config whose query or key/value heads, after
    tensor parallelism's split, ``cp`` does not divide (other models are checked at their first attention)."""
    for fqn, sub in module.named_modules():
        config = getattr(sub, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int) and hasattr(sub, "gradient_checkpointing_enable"):
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            check_heads(heads // tp, kv_heads // tp, cp, f"{fqn or 'the module'} ({type(sub).__name__}, tp={tp})")
            return


# ----------------------------------------------------------------------------------------- attention


@torch.compiler.disable
def _ring_attention(owner: ContextParallel, *args: Any, **kwargs: Any) -> Any:
    """The exchange with the other cp ranks cannot be traced: a compiled block runs it eagerly, as one piece
    (one graph break per attention call instead of several inside it)."""
    return owner.attention(*args, **kwargs)


class _AttentionInterception(TorchFunctionMode):
    """Sends scaled-dot-product attention to the owner; every other function runs as called."""

    def __init__(self, owner: ContextParallel) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return _ring_attention(self.owner, *args, **kwargs)
        return func(*args, **kwargs)

    def __enter__(self):
        self.owner._recomputing += compat.in_backward()
        return super().__enter__()

    def __exit__(self, *exc_info):
        self.owner._recomputing -= compat.in_backward()
        return super().__exit__(*exc_info)



class ContextParallel:
    """The context-parallel side of one module on one rank: batch sharding, positions, attention, checks.

    Per step: :meth:`shard_batch` on the step's batch, then the module runs inside :meth:`context` (or the
    strategy's :meth:`step_context`); :meth:`remove` takes the hooks off the module again.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, comm: str = "ring", seq_dim: int = 1,
                 batch_keys: Optional[Sequence[Union[str, int]]] = None,
                 position_modules: Optional[Sequence[str]] = None, buffers: Optional[Sequence[str]] = None,
                 sequence_parallel: int = 1, document_key: Optional[str] = None, tensor_parallel: int = 1) -> None:
        ContextParallelConfig(dist.get_world_size(group), comm, seq_dim, batch_keys, position_modules, buffers,
                              document_key)
        self.module = module
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm = comm
        self.seq_dim = seq_dim
        self.batch_keys = batch_keys
        self.sequence_parallel = sequence_parallel
        self.position_modules = find_position_modules(module, position_modules)
        self.buffers = find_position_buffers(module, buffers)
        self.sliding_windows = _sliding_windows(module)
        self.document_key = document_key
        if comm == "a2a":
            _check_a2a_heads(module, self.size, tensor_parallel)
        self.attention_calls = 0
        self._facts: Optional[SequenceFacts] = None  # the whole sequences' padding and documents, this step
        self._explained: dict[int, tuple[Tensor, int, Optional[AttentionLayer], tuple[bool, Optional[SequenceMask]]]] = {}
        self._layer: Optional[AttentionLayer] = None  # the Hugging Face attention module running
        self._readings = MaskReadings(tuple(sorted(set(self.sliding_windows.values()))), document_key)
        self._sharded_shapes: dict[str, tuple[int, ...]] = {}  # the last sharded batch's entries, whole
        self._positions: Optional[Tensor] = None  # global positions of this rank's tokens, for the next step
        self._layout: Optional[SequenceLayout] = None  # the next step's layout when balanced for documents
        self._laid_out_causal: Optional[SequenceMask] = None  # causal attention in that layout
        self._seq_len = 0
        self._active = False
        self._verified = False
        self._announced = False
        self.whole_batch: Any = None  # the last batch before sharding, kept for the step check only
        self._shards: list[tuple[Tensor, Tensor]] = []  # the last batch's sharded tensors, each with its whole one
        self.around_step: Optional[Callable[[], AbstractContextManager]] = None  # entered with :meth:`context`
        self.agreeing = False  # the step check's sharded run: attention calls agree on failures (:meth:`agree`)
        self.failure_told = False  # an agreement of that run found a failure: every rank knows
        # Logged names whose combination over the cp ranks the step check learned ("one": the same on every shard)
        self.log_reductions: dict[str, str] = {}
        self._hooks = [
            module.get_submodule(fqn).register_forward_pre_hook(self._position_hook(fqn, arg), with_kwargs=True)
            for fqn, arg in self.position_modules.items()
        ]
        self._hooks += [sub.register_forward_pre_hook(self._labels_hook(fqn), with_kwargs=True)
                        for fqn, sub in module.named_modules() if shifts_labels(sub)]
        for sub in module.modules():  # which attention layer (its causality and window) builds on a mask
            layer = attention_layer(sub)
            if layer is not None:
                self._hooks.append(sub.register_forward_pre_hook(self._layer_hook(layer)))
                self._hooks.append(sub.register_forward_hook(self._layer_hook(None), always_call=True))
        # A module that recomputes its forward during backward (its own activation checkpointing: Hugging
        # Face's, torch.utils.checkpoint in its code) runs outside any interception: a mode is off while its own
        # handler runs, and the step's handler is what called backward. Each module's forward, when run in
        # backward with no interception of a recomputation active, gets a fresh one.
        self._recomputing = 0  # interceptions entered during backward and still active
        self._recompute_entered: list[tuple[nn.Module, _AttentionInterception]] = []
        for sub in module.modules():
            self._hooks.append(sub.register_forward_pre_hook(self._enter_recomputation))
            self._hooks.append(sub.register_forward_hook(self._exit_recomputation, always_call=True))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._readings.stage()
        self._readings.read()  # the last step's masks

    # -------------------------------------------------------------------------------------- batches

    def shard_batch(self, batch: Any, keep_whole: bool = False, host: Any = None) -> Any:
        """This rank's zigzag shard of every sequence tensor of ``batch``; raises before any collective.
        ``keep_whole``: keep ``batch`` as :attr:`whole_batch` (for the step check, which runs the step on it).
        ``host``: the same batch as the data loader gave it, before it went to the device: the masks' decisions
        are taken on its padding and documents, so that the host never reads them back from the device."""
        self._readings.read()  # the last step's masks, checked on the device: their flags are in host memory by now
        self._readings.stage()  # any made since (a recomputation during backward), read at the next batch
        paths, length = sequence_paths(batch, self.seq_dim, self.batch_keys)
        try:
            check_sequence_length(length, self.size, self.sequence_parallel,
                                  where=f"batch[{paths[0]!r}] (dim {self.seq_dim})" if paths[0] else "the batch")
        except ValueError as error:
            first = _tensors(batch)[paths[0]]
            reason = evidently_no_sequence(first, self.seq_dim) if self.batch_keys is None else None
            if reason is None:
                raise
            raise ValueError(
                f"Context parallelism (cp={self.size}) splits dim {self.seq_dim} of every batch tensor as the"
                f" sequence, but {paths[0] or 'the batch'!r} {tuple(first.shape)} is {reason}, not a sequence:"
                f" context parallelism has nothing to split in this module. Use cp=1 (dp=N replicates the model"
                f" instead). If it is a sequence after all, name the sequence tensors with cp_batch_keys (then: {error})"
            ) from error
        if not self._announced:
            rank_zero_info(f"Context parallelism (cp={self.size}) shards {', '.join(repr(p) for p in paths)} on dim"
                           f" {self.seq_dim}; global positions go to modules {sorted(self.position_modules)} and"
                           f" buffers {self.buffers}.")
            self._announced = True
        tensors = _tensors(batch)
        fact_paths = self._fact_paths(tensors, length)
        host_facts = self._host_copies(tensors, _tensors(host) if host is not None else {}, fact_paths)
        self._layout = self._document_layout(host_facts)
        self._laid_out_causal = None if self._layout is None else SequenceMask(causal=True, layout=self._layout)
        positions = positions_of(self._layout, length, self.size, self.rank)
        selected = set(paths)
        on_device: dict[torch.device, Tensor] = {}

        def shard(path: str, tensor: Tensor) -> Tensor:
            if path not in selected:
                return tensor
            index = on_device.setdefault(tensor.device, positions_of(self._layout, length, self.size, self.rank,
                                                                     tensor.device))
            return tensor.index_select(self.seq_dim, index)

        self._sharded_shapes = {path: tuple(tensor.shape) for path, tensor in tensors.items() if path in selected}
        sharded = _map_tensors(batch, shard)
        shards = _tensors(sharded)
        self._shards = [(shards[path], tensors[path]) for path in paths]
        self._positions = next(iter(on_device.values()))
        self._seq_len = length
        self._facts = SequenceFacts(*(tensors[p] if p is not None else None for p in fact_paths), positions,
                                    host=host_facts, device_positions=self._positions, layout=self._layout)
        self._explained = {}
        self.whole_batch = batch if keep_whole else None
        return sharded

    @contextmanager
    def probing(self, batch: Any) -> Iterator[Any]:
        """Shard ``batch`` (a sample, for the step check) for a run inside :meth:`context`, and give the
        step's own batch its shard's state back afterwards."""
        saved = (self._positions, self._seq_len, self._facts, self._explained, self._sharded_shapes, self.whole_batch,
                 self._shards, self._layout, self._laid_out_causal)
        try:
            yield self.shard_batch(batch)
        finally:
            (self._positions, self._seq_len, self._facts, self._explained, self._sharded_shapes,
             self.whole_batch, self._shards, self._layout, self._laid_out_causal) = saved

    def local_positions(self, batch: Any, device: Optional[torch.device] = None) -> Tensor:
        """The global positions this rank would hold of ``batch`` (its layout decided as :meth:`shard_batch`
        decides it), on ``device``; the current batch's layout stays."""
        paths, length = sequence_paths(batch, self.seq_dim, self.batch_keys)
        tensors = _tensors(batch)
        layout = self._document_layout(self._host_copies(tensors, {}, self._fact_paths(tensors, length)))
        return positions_of(layout, length, self.size, self.rank, device)

    def _fact_paths(self, tensors: dict[str, Tensor], length: int) -> tuple[Optional[str], ...]:
        """Where the whole batch's ``attention_mask`` and ``position_ids`` ([batch, length], by name) and the
        named document ids are (None: not in it), for the masks the model builds on its shard (:mod:`.masks`)
        and for the layout."""
        def named(name: str) -> Optional[str]:
            found = [path for path, t in tensors.items() if path.rpartition(".")[2] == name and t.dim() == 2
                     and t.size(1) == length]
            return found[0] if found else None

        if self.document_key is not None:
            documents = tensors.get(self.document_key)
            if documents is None or documents.dim() != 2 or documents.size(1) != length:
                raise ValueError(f"cp_document_key={self.document_key!r}: the batch has no [batch, {length}] tensor"
                                 f" there (tensors: {', '.join(f'{p}: {tuple(t.shape)}' for p, t in tensors.items())}).")
        return named("attention_mask"), named("position_ids"), self.document_key

    @staticmethod
    def _host_copies(tensors: dict[str, Tensor], host: dict[str, Tensor],
                     paths: tuple[Optional[str], ...]) -> tuple[Optional[Tensor], ...]:
        """The tensors at ``paths`` in host memory: ``host``'s tensor at the same path (the batch as the data
        loader gave it), or else (a batch the loader put on the device) read back."""
        def on_host(path: Optional[str]) -> Optional[Tensor]:
            if path is None:
                return None
            given = host.get(path)
            if given is not None and given.device.type == "cpu" and given.shape == tensors[path].shape:
                return given
            return tensors[path].cpu()

        return tuple(on_host(path) for path in paths)

    def _document_layout(self, host_facts: tuple[Optional[Tensor], ...]) -> Optional[SequenceLayout]:
        """The document-balanced layout (:mod:`.document_layout`) when some row of the batch packs documents (the
        ids ``cp_document_key`` names, or else ``position_ids`` that restart), or None: the zigzag. Decided on the
        host copies of the batch's facts."""
        _, position_ids, documents = host_facts
        if documents is None and position_ids is not None:
            documents = packed_documents(position_ids)
        if documents is None or not SequenceMask(documents=documents).splits_documents():
            return None
        return balanced_layout(documents, self.size)

    def select_rows(self, index: int, count: int) -> None:
        """Pipeline parallelism runs micro-batch ``index`` of ``count``: its rows of the step's facts apply."""
        if self._facts is not None and not self._facts.empty:
            self._facts.select(index, count)

    # -------------------------------------------------------------------------------------- the step

    @contextmanager
    def context(self) -> Iterator[None]:
        """Runs the module on the shard of the last :meth:`shard_batch` as if on the whole sequence (any number
        of times: pipeline parallelism runs a step per micro-batch); before any, it changes nothing."""
        if self._positions is None:
            yield
            return
        calls = self.attention_calls
        swapped = self._swap_buffers()
        self._active = True
        _RUNNING.append(self)
        try:
            with _AttentionInterception(self), (self.around_step() if self.around_step is not None else nullcontext()):
                yield
        except Exception as error:
            if not self._verified and self.attention_calls == calls:
                raise ValueError(self._failed_before_attention(error)) from error
            raise
        finally:
            _RUNNING.pop()
            self._active = False
            for owner, name, original in swapped:
                compat.buffers_of(owner)[name] = original
            self._readings.stage()
        if not self._verified:
            if self.attention_calls == calls:
                error = RuntimeError(
                    f"Context parallelism (cp={self.size}) split each sequence over {self.size} ranks, but the first"
                    f" step of {type(self.module).__name__} made no scaled_dot_product_attention call, so its"
                    " attention saw only this rank's tokens. The model computes attention some other way (e.g. a"
                    " hand-written softmax, or Hugging Face attn_implementation='eager'): use"
                    " torch.nn.functional.scaled_dot_product_attention (attn_implementation='sdpa'), or cp=1.")
                setattr(error, MODEL_REFUSAL, True)
                raise error
            self._verified = True

    def _failed_before_attention(self, error: Exception) -> str:
        shapes = ", ".join(f"{path or 'the batch'!r} {shape}" for path, shape in self._sharded_shapes.items())
        return (f"Context parallelism (cp={self.size}) split dim {self.seq_dim} of {shapes} as the sequence, and the"
                f" first step of {type(self.module).__name__} failed before any scaled_dot_product_attention call:"
                f" {type(error).__name__}: {error}. If that dim is no sequence (the features of a regression, an"
                " image), context parallelism has nothing to split: use cp=1 (dp=N replicates the model instead). If"
                " the sequence is another dim, or only some batch entries are sequences, name them with cp_seq_dim"
                " or cp_batch_keys.")

    def _enter_recomputation(self, module: nn.Module, args: tuple) -> None:
        if self._positions is not None and self._recomputing == 0 and compat.in_backward():
            mode = _AttentionInterception(self)
            mode.__enter__()
            self._recompute_entered.append((module, mode))

    def _exit_recomputation(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._recompute_entered and self._recompute_entered[-1][0] is module:
            self._recompute_entered.pop()[1].__exit__(None, None, None)

    def recompute_context(self) -> AbstractContextManager[None]:
        """Entered around a block that recomputes its forward during backward (activation checkpointing):
        backward runs outside the step's interception, so the recomputed attention is ring attention again only
        inside a fresh one (positions and tables are the checkpointed block's saved inputs)."""
        return _AttentionInterception(self) if self._positions is not None else nullcontext()

    @contextmanager
    def step_context(self) -> Iterator[None]:
        """:meth:`context` for a Lightning step; the step's ``self.log`` values become whole-sequence values."""
        if self._positions is None:
            yield
            return
        logs = StepLogs(self.module)
        with self.context(), logs.recording():
            yield
        values = logs.combined()
        StepLogs.all_reduce(values, self.group, self.log_reductions)
        logs.replay(values)

    def global_loss(self, output: Any) -> Any:
        """A training step's output whose loss shows the whole sequence's mean; its gradient stays local."""
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            return output
        total = compat.all_reduce_in_stream(loss.detach(), "sum", self.group)
        loss = loss + (total / self.size - loss).detach()
        return {**output, "loss": loss} if isinstance(output, Mapping) else loss

    def _swap_buffers(self) -> list[tuple[nn.Module, str, Tensor]]:
        swapped = []
        for fqn in self.buffers:
            owner_name, _, name = fqn.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            table = compat.buffers_of(owner)[name]
            if table.dim() == 0 or table.size(0) < self._seq_len:
                raise ValueError(f"Buffer {fqn} of shape {tuple(table.shape)} has fewer rows than the sequence length"
                                 f" {self._seq_len}, so it cannot be indexed by global position; exclude it with"
                                 " cp_buffers=[...] if it is not a per-position table.")
            swapped.append((owner, name, table))
            compat.buffers_of(owner)[name] = table.index_select(0, self._positions.to(table.device))
        return swapped

    def _position_hook(self, fqn: str, arg: str) -> Callable:
        index = _forward_parameters(self.module.get_submodule(fqn)).index(arg)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if not self._active:
                return None
            if kwargs.get(arg) is not None:
                return args, {**kwargs, arg: self._global_positions(kwargs[arg], fqn)}
            if index < len(args) and args[index] is not None:
                return (*args[:index], self._global_positions(args[index], fqn), *args[index + 1:]), kwargs
            # Left to itself the module would number this rank's shard 0..T-1: wrong under the zigzag split.
            raise ValueError(f"{fqn} ({type(module).__name__}) was called without `{arg}`, so it would compute"
                             " positions from this rank's shard of the sequence; context parallelism needs the"
                             f" caller to pass `{arg}` (or leave {fqn} out of cp_position_modules and pass"
                             " global position ids in the batch with cp_batch_keys).")

        return hook

    def _layer_hook(self, layer: Optional[AttentionLayer]) -> Callable:
        def hook(*_: Any) -> None:
            self._layer = layer

        return hook

    def _labels_hook(self, fqn: str) -> Callable:
        """A model that shifts its ``labels`` itself would pair each shard's last token of a chunk with the first
        of the next chunk on this rank; it gets ``shift_labels=``: the batch's labels shifted over the whole
        sequence, then sharded, so each token keeps the target one process gives it."""
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            labels = kwargs.get("labels")
            if not self._active or labels is None or kwargs.get("shift_labels") is not None:
                return None
            shifted = shifted_labels(labels, self._shards, self.seq_dim, self._positions)
            if shifted is None:
                raise ValueError(
                    f"{fqn or type(module).__name__} was called with labels= that are not a tensor of the batch as"
                    " context parallelism sharded it (they were changed or built in the step), and Hugging Face"
                    " shifts labels by one token inside the model: the next token of a shard's last one is on"
                    " another rank. Pass the batch's labels unchanged (mask them in the data), or pass"
                    " shift_labels= (shifted over the whole sequence in the data) as well.")
            return args, {**kwargs, "shift_labels": shifted}

        return hook

    def _global_positions(self, positions: Any, fqn: str) -> Any:
        """Local default positions ``0..T-1`` become the tokens' global ones; anything else (position ids
        sharded from the batch) already is global. Chosen on the device: the host never reads which it was."""
        if not isinstance(positions, Tensor):
            return positions
        local = self._positions.numel()
        if positions.dim() == 0 or positions.size(-1) != local:
            raise ValueError(f"{fqn} received positions of shape {tuple(positions.shape)}, but this rank holds {local}"
                             f" tokens of each sequence; if it is not a position module, leave it out of"
                             f" cp_position_modules.")
        defaults = (positions == torch.arange(local, device=positions.device, dtype=positions.dtype)).all()
        return torch.where(defaults, self._positions.to(positions.device, positions.dtype), positions)

    def attention(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False) -> Tensor:
        """``F.scaled_dot_product_attention`` over the whole sequence, computed as ring attention."""
        self.attention_calls += 1
        if not self.agreeing:
            operands = self._operands(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        else:  # the step check: a mask one rank of the group cannot read stops every rank here, none waits
            try:
                operands, failure = self._operands(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                   enable_gqa), None
            except Exception as error:  # noqa: BLE001  raised below, once the group knows
                operands, failure = None, error
            if self.agree(failure is not None):
                raise failure if failure is not None else PeerFailed(
                    "another rank of the context-parallel group failed at this attention call (its error follows)")
        q, k, v, lead, value_dim, is_causal, scale, mask = operands
        if self.comm == "a2a":
            out = ulysses_attention(q, k, v, group=self.group, is_causal=bool(is_causal), scale=scale, mask=mask)
        else:
            out = ring_attention(q, k, v, group=self.group, is_causal=bool(is_causal), scale=scale, comm=self.comm,
                                 mask=mask)
        return out[..., :value_dim].reshape(*lead, *out.shape[2:-1], value_dim)

    def agree(self, failed: bool) -> bool:
        """Whether any rank of the group failed (each says whether it did); for the step check, which calls it at
        every attention call of its sharded run and once after it (a rank that failed elsewhere says so there)."""
        flag = torch.tensor([float(failed)], device=self._positions.device)
        dist.all_reduce(flag, group=self.group)
        told = bool(flag.item() > 0)  # the step check's first batch only, never a training step
        self.failure_told = self.failure_told or told
        return told

    def _operands(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                  is_causal: bool, scale: Optional[float], enable_gqa: bool) -> tuple:
        """The call's operands for ring attention and its mask over the whole sequence; raises what cannot be."""
        local = self._positions.numel()
        if query.dim() < 3 or query.size(-2) != local or key.size(-2) != local:
            raise ValueError(
                f"scaled_dot_product_attention got query {tuple(query.shape)} and key {tuple(key.shape)}, but context"
                f" parallelism supports only self-attention over the sharded sequence ({local} tokens per rank on"
                " dim -2).")
        if dropout_p:
            raise ValueError(f"Attention dropout (dropout_p={dropout_p}) is not supported under context parallelism;"
                             " set it to 0.")
        if attn_mask is not None:
            if is_causal:
                raise ValueError("scaled_dot_product_attention: an explicit attn_mask cannot be set with"
                                 " is_causal=True.")
        # torch's shape rules: a single key/value head broadcasts over the query heads without enable_gqa.
        q, k, v, lead = sdpa_operands(query, key, value, enable_gqa)
        value_dim = v.size(-1)
        if value_dim != q.size(-1):
            # Ring attention's kernels take equal head sizes (multi-head latent attention's value heads are
            # narrower than its query/key heads): zero columns change neither q.k nor the value's own columns.
            scale = q.size(-1) ** -0.5 if scale is None else scale
            width = max(value_dim, q.size(-1))
            q, k, v = (F.pad(t, (0, width - t.size(-1))) for t in (q, k, v))
        if attn_mask is not None:
            is_causal, mask = self._mask_meaning(attn_mask, local)
        else:
            mask = unmasked(bool(is_causal), self._facts, self._layer, q.size(0), self._seq_len,
                            recomputing=compat.in_backward())
            is_causal = is_causal and mask is None
        if is_causal and self._laid_out_causal is not None:  # causal order over shards laid out for documents
            is_causal, mask = False, self._laid_out_causal
        return q, k, v, lead, value_dim, is_causal, scale, mask

    def _mask_meaning(self, attn_mask: Tensor, local: int) -> tuple[bool, Optional[SequenceMask]]:
        """``(is_causal, SequenceMask or None)`` over the whole sequence for a mask the model built on its shard.
        Models build a mask per forward and pass it to every layer: it is looked at once per layer kind, not per
        call; what it is made of, :class:`~.masks.MaskReadings`."""
        key = id(attn_mask)
        cached = self._explained.get(key)
        version = compat.tensor_version(attn_mask)
        if cached is not None and cached[0] is attn_mask and cached[1] == version and cached[2] == self._layer:
            return cached[3]
        reading = self._readings.of(attn_mask, local, self._facts, self._layer)
        found = self._facts.mask(reading, attn_mask.size(0) if attn_mask.dim() == 4 else 1, self._seq_len)
        plain = found.window is None and found.key_valid is None and found.documents is None
        meaning = (found.causal, None) if plain else (False, found)
        self._explained[key] = (attn_mask, version, self._layer, meaning)
        return meaning
