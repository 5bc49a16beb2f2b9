"""The LM head's cross entropy computed from the head's input in chunks of tokens: logits that never exist whole.

In a long-sequence step the largest tensors are the LM head's logits, their softmax and their gradient, each
tokens x vocabulary. While a step runs, :class:`ChunkedHeadLoss` makes the head (an ``nn.Linear`` from the
token embedding's width to its rows) return :class:`DeferredLogits`: a tensor with the logits' shape and dtype
and no storage (every stride 0) that remembers the head's input and weights. The usual chain from there to the
loss (``view`` / ``reshape`` / ``flatten`` / ``float`` / ``to`` / ``contiguous`` / slicing and boolean-mask
selection of tokens / ``log_softmax`` over the vocabulary) only changes which rows and dtypes it stands for, and
``F.cross_entropy`` or ``F.nll_loss`` on it runs :mod:`.chunked_cross_entropy`: a chunk of tokens' logits at a
time, each chunk's gradient with respect to the head's input and weights formed while its loss is (the step's
matmuls stay three, as without fusion), backward only scaling them. Class weights, ``ignore_index``, label
smoothing and every ``reduction`` hold, and :mod:`.token_losses` sees the call as it sees any other.

Any other use of the logits (an argmax for accuracy, a metric, ``softmax``, returning them from the step) gets
them computed whole, as without fusion: correct first, and the first such use says why once. Changing them in
place is refused (a copy would lose the change). When the step ends, logits returned in its output are computed
whole and any other deferred logits are closed: using one after the step raises instead of reading weights the
optimizer has changed since.

Under a pipeline schedule that runs every micro-batch's forward before any backward (GPipe, looped BFS), the
gradients are formed in backward from each chunk's logits computed again, so that no micro-batch holds a
weight-sized gradient until then. That costs one more head matmul per micro-batch, on the schedule's critical
path; so a plain head whose logits, every micro-batch's together, fit in one chunk runs as written there: whole
logits then take no more memory than one chunk would (:meth:`ChunkedHeadLoss.schedule`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_4d import _compat as compat
from lightning_4d._compat import tree_flatten, tree_map
from lightning_4d.numerics.chunked_cross_entropy import ChunkedCrossEntropy
from lightning_4d.numerics.token_losses import weighed

# Logits per chunk: as many as the head's input has elements (a chunk's logits then take about the memory its
# input already does), and at least MIN_CHUNK_ELEMENTS (16 MiB in fp32), so that short sequences are few chunks.
MIN_CHUNK_ELEMENTS = 1 << 22
_local = threading.local()


@contextmanager
def deferring() -> Iterator[None]:
    """Inside, fused heads return :class:`DeferredLogits` (a training, validation or test step; not predict)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def find_lm_head(module: nn.Module) -> Optional[str]:
    """The LM head: an ``nn.Linear`` outside repeated blocks that maps the token embedding's width back to its
    rows (the token embedding: the ``nn.Embedding`` with the most rows not named for positions), one tied to the
    embedding first; None when there is none."""
    modules = dict(module.named_modules())
    embeddings = [(name, m) for name, m in modules.items() if isinstance(m, nn.Embedding)
                  and not any(w in name.rsplit(".", 1)[-1] for w in ("position", "wpe", "pos_emb"))]
    if not embeddings:
        return None
    _, embedding = max(embeddings, key=lambda e: e[1].num_embeddings)
    heads = [(name, m) for name, m in modules.items() if type(m).forward is nn.Linear.forward
             and isinstance(m, nn.Linear) and (m.in_features, m.out_features) == (embedding.embedding_dim,
                                                                                  embedding.num_embeddings)
             and not any(part.isdigit() for part in name.split("."))]
    heads.sort(key=lambda h: h[1].weight is not embedding.weight)
    return heads[0][0] if heads else None


class ChunkedHeadLoss:
    """Installed on one LM head (``name``): inside :func:`deferring` its forward returns :class:`DeferredLogits`
    for plain-tensor inputs and weights (a tensor-parallel head's DTensors run its own forward)."""

    def __init__(self, name: str, head: nn.Linear, chunk_elements: Optional[int] = None) -> None:
        self.name, self.head = name, head
        self.chunk_elements = chunk_elements  # None: see MIN_CHUNK_ELEMENTS
        # Form the gradients in backward from the chunks' logits again, instead of with the loss: set where many
        # forwards run before their backwards (GPipe), which would each hold a weight-sized gradient until then.
        self.gradients_in_backward = False
        # Logits per micro-batch up to which the head runs as written (0: none). Set beside gradients_in_backward,
        # where chunks would compute the head again in backward, on the schedule's critical path, while every
        # micro-batch's logits, held whole from forward to backward, would fit in one chunk's memory.
        self.whole_elements = 0
        self.open: list[_Head] = []  # this step's deferred heads, closed by :meth:`close`
        self.fused = 0  # cross entropies computed in chunks
        self.fallbacks = 0  # uses that computed the logits whole
        self._warned = False
        head.forward = self._forward  # an instance attribute: the class's forward stays for everyone else

    def remove(self) -> None:
        """Back to the head's own forward."""
        self.head.__dict__.pop("forward", None)

    def _forward(self, input: Tensor) -> Tensor:
        weight, bias = self.head.weight, self.head.bias
        tensors = (input, weight) + ((bias,) if bias is not None else ())
        plain = all(type(t) in (Tensor, nn.Parameter) for t in tensors)
        # Outside a step, inside a torch.compile of the user's own (its graph cannot hold deferred logits), or a
        # head whose weights are neither plain nor split by tensor parallelism's column-wise style: as written.
        if (getattr(_local, "depth", 0) == 0 or torch.compiler.is_compiling() or input.dim() < 1
                or not (plain or _vocabulary_sharded(input, weight, bias))
                or (plain and input[..., 0].numel() * weight.shape[0] <= self.whole_elements)):
            return nn.Linear.forward(self.head, input)
        deferred = _Head(self, input, weight, bias)
        self.open.append(deferred)
        index = torch.arange(input[..., 0].numel(), device=input.device).view(input.shape[:-1])
        return DeferredLogits._make(deferred, index, (), deferred.dtype, identity=True)

    def schedule(self, forwards_first: bool, microbatches: int) -> None:
        """A pipeline schedule's: where every micro-batch's forward runs before any backward (GPipe, looped BFS),
        form the gradients in backward (none weight-sized held per micro-batch) and leave a plain head whose
        logits, every micro-batch's together, fit in one chunk as written (:func:`whole_logits_elements`)."""
        self.gradients_in_backward = forwards_first
        self.whole_elements = whole_logits_elements(forwards_first, microbatches)

    def chunk_tokens(self, rows: Tensor, columns: int) -> int:
        """Tokens per chunk for ``rows`` (tokens x hidden) against ``columns`` vocabulary entries on this rank."""
        elements = self.chunk_elements or max(MIN_CHUNK_ELEMENTS, rows.numel())
        return max(1, elements // columns)

    def fell_back(self, reason: str) -> None:
        """Count a use that computed the logits whole; say why the first time."""
        self.fallbacks += 1
        if not self._warned:
            self._warned = True
            rank_zero_warn(f"The LM head {self.name}'s logits were computed whole for {reason}: only a cross entropy"
                           " (or nll_loss of log_softmax) of them, reached through view/reshape/float/to/contiguous/"
                           "slicing, is computed in chunks. The result is the same; the memory is the unfused"
                           " path's. (This is said once.)")

    def close(self) -> None:
        """The step ended: its deferred logits can no longer be computed (the weights will change)."""
        for deferred in self.open:
            deferred.close()
        self.open.clear()


class _Head:
    """What one call of the head saw: its input, weights and autocast state."""

    def __init__(self, owner: ChunkedHeadLoss, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
        self.owner, self.input = owner, input
        self.group, self.vocab_start, self.sharded = None, 0, None
        if isinstance(weight, DTensor):  # tensor parallelism: this rank's rows of the vocabulary
            mesh = weight.device_mesh
            self.group, self.vocab_start = mesh.get_group(), mesh.get_local_rank() * weight.to_local().shape[0]
            self.sharded = (weight, bias)
            # the rows' gradient from this rank's vocabulary is a part of the whole one: DTensor sums the parts
            input = input.to_local(grad_placements=[Partial()])
            weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
        self.weight, self.bias = weight, bias
        self.device_type = input.device.type
        self.autocast = torch.is_autocast_enabled(self.device_type)
        self.autocast_dtype = torch.get_autocast_dtype(self.device_type)
        if self.autocast:
            self.dtype = self.autocast_dtype
        else:
            self.dtype = torch.promote_types(input.dtype, weight.dtype)
        self.vocab = weight.shape[0] * (dist.get_world_size(self.group) if self.group is not None else 1)
        self.rows = input.reshape(-1, input.shape[-1]) if input.dim() > 1 else input.unsqueeze(0)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.input = self.weight = self.bias = self.rows = self.sharded = None

    def autocast_context(self) -> Any:
        """The autocast state the head ran under (the loss may run under another)."""
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast)

    def linear(self, rows: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        with self.autocast_context():
            return F.linear(rows, weight, bias)

    def whole_rows(self) -> Tensor:
        """The head's output rows, every one, as the unfused path computes them (gathered under tp)."""
        if self.group is None:
            return self.linear(self.rows, self.weight, self.bias)
        with self.autocast_context():
            out = F.linear(self.input, *self.sharded).full_tensor()
        return out.reshape(-1, self.vocab)


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__init__", "__iter__",
                                                                             "__invert__")) \
        or (name.endswith("_") and not name.startswith("_")) or name == "__setitem__"


class _RowOp:
    """What was applied to every row of the logits, the same for each token: a dtype change (``kind="dtype"``),
    ``log_softmax`` over the vocabulary, or an elementwise op whose other operands vary at most along the
    vocabulary (``logits / t``, ``logits.masked_fill_(bad_tokens, -inf)``, ``logits[..., 0] = -1``, a
    softcap's ``tanh``). ``apply(x, columns)``: on a chunk ``x`` holding the vocabulary's ``columns``."""

    def __init__(self, kind: str, func: Callable[[Tensor, slice], Tensor], dtype: Optional[torch.dtype] = None):
        self.kind, self.func, self.dtype = kind, func, dtype

    def apply(self, x: Tensor, columns: slice) -> Tensor:
        return self.func(x, columns)


def _per_vocabulary(value: Any, vocab: int) -> bool:
    """An operand that is the same for every token: a number, or a tensor whose dims before the last are 1 and
    whose last is 1 or the vocabulary."""
    if isinstance(value, (int, float, bool)):
        return True
    if not isinstance(value, Tensor) or isinstance(value, DeferredLogits):
        return False
    return value.dim() == 0 or (all(size == 1 for size in value.shape[:-1]) and value.shape[-1] in (1, vocab))


def _columns_of(value: Any, columns: slice) -> Any:
    """A per-vocabulary operand's entries for ``columns`` (all of it when it does not vary)."""
    if isinstance(value, Tensor) and value.dim() and value.shape[-1] > 1:
        return value.reshape(-1)[columns]
    return value.reshape(()) if isinstance(value, Tensor) and value.dim() else value


_METADATA = {Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.__len__, Tensor.element_size,
             Tensor.get_device, Tensor.is_floating_point, Tensor.ndimension, Tensor.is_complex}
_DTYPE = {Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to, Tensor.type_as, Tensor.type}
_SHAPE = {Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten, Tensor.view_as,
          Tensor.reshape_as}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, Tensor.log_softmax}
_UNCHANGED = {Tensor.contiguous}
_ELEMENTWISE = {Tensor.mul, Tensor.__mul__, Tensor.__rmul__, torch.mul, Tensor.div, Tensor.__truediv__, torch.div,
                Tensor.add, Tensor.__add__, Tensor.__radd__, torch.add, Tensor.sub, Tensor.__sub__, torch.sub,
                Tensor.masked_fill, Tensor.clamp, torch.clamp, Tensor.tanh, torch.tanh}
_OUT_OF_PLACE = {Tensor.mul_: Tensor.mul, Tensor.__imul__: Tensor.mul, Tensor.div_: Tensor.div,
                 Tensor.__itruediv__: Tensor.div, Tensor.add_: Tensor.add, Tensor.__iadd__: Tensor.add,
                 Tensor.sub_: Tensor.sub, Tensor.__isub__: Tensor.sub, Tensor.masked_fill_: Tensor.masked_fill,
                 Tensor.clamp_: Tensor.clamp, Tensor.tanh_: Tensor.tanh}
_ELEMENTWISE_IN_PLACE = {Tensor.mul_, Tensor.__imul__, Tensor.div_, Tensor.__itruediv__, Tensor.add_, Tensor.__iadd__,
                         Tensor.sub_, Tensor.__isub__, Tensor.masked_fill_, Tensor.clamp_, Tensor.tanh_}


class DeferredLogits(Tensor):
    """LM-head logits not computed yet: the rows of the head's output they stand for (``_index``, the shape
    without the vocabulary), what was applied to each row (``_row_ops``, :class:`_RowOp`), and
    storage-free metadata (every stride 0) for code that asks their shape, dtype or device."""

    _head: _Head
    _index: Tensor
    _row_ops: tuple
    _identity: bool  # the head's output rows in order, whole

    @staticmethod
    def _make(head: _Head, index: Tensor, row_ops: tuple, dtype: torch.dtype, identity: bool = False
              ) -> "DeferredLogits":
        with compat.without_subclass_functions():
            empty = torch.empty((), dtype=dtype, device=index.device).expand(*index.shape, head.vocab)
        out = empty.as_subclass(DeferredLogits)
        out._head, out._index, out._row_ops, out._identity = head, index, row_ops, identity
        out._derived = False
        return out

    def _with(self, index: Tensor, row_ops: tuple, dtype: torch.dtype, identity: bool) -> "DeferredLogits":
        self._derived = True  # a later change in place of these logits could not reach what is derived now
        return DeferredLogits._make(self._head, index, row_ops, dtype, identity)

    # ----------------------------------------------------------------------------- computing them whole

    def _whole(self) -> Tensor:
        """The logits as the unfused path computes them (through autograd, to the head's input and weights)."""
        head = self._head
        if head.closed:
            raise RuntimeError(
                f"The LM head {head.owner.name}'s logits were used after the step that computed them ended. They"
                " are computed on use (FourDStrategy fuses the head with its cross entropy), and the weights may"
                " have changed since. Fix: use them inside the step, return them from the step (they are computed"
                " then), or FourDStrategy(fuse_lm_loss=False).")
        if head.group is not None:
            logits = head.whole_rows()
            logits = logits if self._identity else logits.index_select(0, self._index.reshape(-1))
        else:
            rows = head.rows if self._identity else head.rows.index_select(0, self._index.reshape(-1))
            logits = head.linear(rows, head.weight, head.bias)
        for op in self._row_ops:
            logits = op.apply(logits, slice(0, head.vocab))
        return logits.view(*self._index.shape, logits.shape[-1])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with compat.without_subclass_functions():
                out = func(*args, **kwargs)
            if not isinstance(out, Tensor):
                return out
        deferred = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DeferredLogits)]
        self = args[0] if args and isinstance(args[0], DeferredLogits) else None
        in_place = _in_place(func) and (self is not None or isinstance(kwargs.get("out"), DeferredLogits))
        if len(deferred) == 1 and not deferred[0]._head.closed:
            if self is not None and len(args) >= 1:
                out = self._follow(func, args[1:], kwargs)
                if out is not None:
                    return out
        if in_place:
            owner = deferred[0]._head.owner.name
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} changes the LM head {owner}'s logits in place in a way"
                " FourDStrategy cannot apply to each chunk of tokens (it computes them in chunks inside the cross"
                " entropy, and whole for any other use): only elementwise changes the same for every token are (a"
                " number, or a tensor along the vocabulary: *=, /=, +=, -=, masked_fill_, clamp_, tanh_, logits[...,"
                " ids] = value), made before anything else is derived from the logits. Fix: the out-of-place form"
                " (logits = logits.masked_fill(mask, value)), or FourDStrategy(fuse_lm_loss=False).")
        if len(deferred) == 1 and not deferred[0]._head.closed:
            if func in (F.cross_entropy, F.nll_loss):
                out = _fused_loss(func, args, kwargs)
                if out is not None:
                    return out
        if deferred and not deferred[0]._head.closed:
            deferred[0]._head.owner.fell_back(f"{getattr(func, '__qualname__', func)}")
        args, kwargs = tree_map(lambda a: a._whole() if isinstance(a, DeferredLogits) else a, (args, kwargs))
        return func(*args, **kwargs)

    def _elementwise(self, func: Any, rest: tuple, kwargs: dict) -> Optional["DeferredLogits"]:
        """An elementwise op the same for every token, kept as a row op: a new :class:`DeferredLogits`, or these
        logits themselves changed in place; None for one that varies by token."""
        in_place = func in _ELEMENTWISE_IN_PLACE or func is Tensor.__setitem__
        vocab = self._head.vocab
        if func is Tensor.__setitem__:
            mask = _vocabulary_mask(self, rest[0]) if len(rest) == 2 else None
            value = rest[1] if len(rest) == 2 else None
            if mask is None or not (isinstance(value, (int, float, bool)) or (
                    isinstance(value, Tensor) and value.dim() == 0 and not isinstance(value, DeferredLogits))):
                return None
            op = _RowOp("elementwise", lambda x, columns: x.masked_fill(mask[columns], value))
        else:
            if not all(_per_vocabulary(a, vocab) or a is None or isinstance(a, str) for a in (*rest, *kwargs.values())):
                return None
            base = _OUT_OF_PLACE.get(func, func)

            def run(x: Tensor, columns: slice) -> Tensor:
                out = base(x, *(_columns_of(a, columns) for a in rest),
                           **{k: _columns_of(v, columns) for k, v in kwargs.items()})
                return out.to(x.dtype) if in_place else out

            op = _RowOp("elementwise", run)
        if not in_place:
            probe = torch.zeros((), dtype=self.dtype, device=self.device)
            with compat.without_subclass_functions():
                dtype = op.apply(probe, slice(0, 1)).dtype
            return self._with(self._index, self._row_ops + (op,), dtype, self._identity)
        if self._derived:
            return None  # refused by the caller: what was derived before would miss the change
        self._row_ops = self._row_ops + (op,)
        return self

    def _follow(self, func: Any, rest: tuple, kwargs: dict) -> Optional["DeferredLogits"]:
        """The chain from the head to the loss: a new :class:`DeferredLogits`, or None for any other use."""
        vocab = self._head.vocab
        if func in _UNCHANGED:
            return self
        if func in _DTYPE:
            probe = torch.empty((), dtype=self.dtype, device=self.device)
            with compat.without_subclass_functions():
                rest = tuple(a.as_subclass(Tensor) if isinstance(a, Tensor) else a for a in rest)
                converted = func(probe, *rest, **kwargs)
            if not isinstance(converted, Tensor) or converted.device != self.device or converted.dim() != 0:
                return None
            if converted.dtype == self.dtype:
                return self
            dtype = converted.dtype
            op = _RowOp("dtype", lambda x, columns, d=dtype: x.to(d), dtype)
            return self._with(self._index, self._row_ops + (op,), dtype, self._identity)
        if func in _LOG_SOFTMAX:
            dim = kwargs.get("dim", rest[0] if rest else None)
            dtype = kwargs.get("dtype", rest[2] if len(rest) > 2 else None)
            if dim not in (-1, self.dim() - 1) or len(rest) > 3 or set(kwargs) - {"dim", "dtype", "_stacklevel"}:
                return None

            op = _RowOp("log_softmax", lambda x, columns, d=dtype: F.log_softmax(x, -1, dtype=d), dtype)
            return self._with(self._index, self._row_ops + (op,), dtype or self.dtype, self._identity)
        if func in _ELEMENTWISE or func in _ELEMENTWISE_IN_PLACE or func is Tensor.__setitem__:
            return self._elementwise(func, rest, kwargs)
        if func in _SHAPE:
            if any(isinstance(a, torch.dtype) for a in (*rest, *kwargs.values())):
                return None  # view(dtype) reinterprets the bits
            rest = tuple(a.shape if isinstance(a, Tensor) else a for a in rest)  # view_as / reshape_as
            meta = torch.empty(self.shape, device="meta")
            shape_func = {Tensor.view_as: Tensor.view, Tensor.reshape_as: Tensor.reshape}.get(func, func)
            try:
                shape = shape_func(meta, *rest, **kwargs).shape
            except (RuntimeError, TypeError):
                return None
            if len(shape) == 0 or shape[-1] != vocab:
                return None
            return self._with(self._index.reshape(shape[:-1]), self._row_ops, self.dtype, self._identity)
        if func is Tensor.__getitem__ and len(rest) == 1:
            index = _select_rows(self, rest[0])
            if index is None:
                return None
            return self._with(index, self._row_ops, self.dtype, False)
        return None


def _select_rows(logits: DeferredLogits, key: Any) -> Optional[Tensor]:
    """The token positions ``logits[key]`` keeps, when ``key`` leaves the vocabulary whole and in order."""
    parts = key if isinstance(key, tuple) else (key,)
    if any(isinstance(p, (list, range)) for p in parts):
        return None
    tokens = logits.dim() - 1
    if any(isinstance(p, Tensor) for p in parts):  # advanced indexing: only over the token dims
        if Ellipsis in parts or any(p is None for p in parts):
            return None
        if len(parts) == tokens + 1 and parts[-1] == slice(None):
            parts = parts[:-1]
        dims = sum(p.dim() if isinstance(p, Tensor) and p.dtype == torch.bool else 1 for p in parts)
        if dims > tokens:
            return None
        parts = tuple(p.as_subclass(Tensor) if isinstance(p, Tensor) else p for p in parts)
        with compat.without_subclass_functions():
            return logits._index[parts]
    # Basic indexing: the vocabulary stays whole and in order when a probe numbered along it is unchanged.
    vocab = logits.shape[-1]
    probe = torch.arange(vocab).expand(*logits.shape)
    try:
        picked = probe[key]
    except (IndexError, TypeError, RuntimeError):
        return None
    if picked.dim() == 0 or picked.shape[-1] != vocab or picked.stride(-1) != 1 or picked.storage_offset() != 0:
        return None
    with compat.without_subclass_functions():
        rows = logits._index.unsqueeze(-1)[key]
    return rows.squeeze(-1) if rows.shape[:-1] == picked.shape[:-1] and rows.shape[-1] == 1 else None


def _vocabulary_mask(logits: DeferredLogits, key: Any) -> Optional[Tensor]:
    """For ``logits[key] = value``: the vocabulary entries ``key`` picks for every token (``[..., ids]``, or every
    token dim whole then ``ids``), as a boolean mask over the vocabulary; None for a key that picks tokens."""
    parts = key if isinstance(key, tuple) else (key,)
    if len(parts) == 2 and parts[0] is Ellipsis:
        ids = parts[1]
    elif len(parts) == logits.dim() and all(p == slice(None) for p in parts[:-1] if not isinstance(p, Tensor)) \
            and not any(isinstance(p, Tensor) for p in parts[:-1]):
        ids = parts[-1]
    else:
        return None
    if isinstance(ids, Tensor):
        if isinstance(ids, DeferredLogits) or ids.dim() != 1:
            return None
        ids = ids.as_subclass(Tensor)
    elif not isinstance(ids, (int, slice, list)):
        return None
    mask = torch.zeros(logits._head.vocab, dtype=torch.bool, device=logits._index.device)
    mask[ids] = True
    return mask


_LOSS_ARGUMENTS = {F.cross_entropy: ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                                     "reduction", "label_smoothing"),
                   F.nll_loss: ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")}
_DEFAULTS = dict(weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0)


def _fused_loss(func: Any, args: tuple, kwargs: dict) -> Optional[Tensor]:
    """``func`` (cross entropy or NLL) of deferred logits, in chunks; None when the call is not one it computes
    alike (the caller computes the logits whole then)."""
    names = _LOSS_ARGUMENTS[func]
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    call = dict(_DEFAULTS, **dict(zip(names, args)), **kwargs)
    logits, target = call["input"], call["target"]
    if (not isinstance(logits, DeferredLogits) or logits.dim() != 2 or call["size_average"] is not None
            or call["reduce"] is not None or call["reduction"] not in ("mean", "sum", "none")
            or not isinstance(target, Tensor) or isinstance(target, DeferredLogits) or target.is_floating_point()
            or target.shape != logits.shape[:1]):
        return None
    kinds = [op.kind for op in logits._row_ops]
    if func is F.nll_loss and "log_softmax" not in kinds:
        return None  # nll of anything but log-probabilities is not a cross entropy
    if logits._head.group is not None and "log_softmax" in kinds and "elementwise" in kinds[kinds.index("log_softmax"):]:
        return None  # an op of log-probabilities computed over a share of the vocabulary would not be the same
    head = logits._head
    rows = head.rows if logits._identity else head.rows.index_select(0, logits._index.reshape(-1))
    smoothing = call.get("label_smoothing", 0.0)
    weight = call["weight"]
    head.owner.fused += 1

    def compute(reduction: str) -> Tensor:
        options = (head, logits._row_ops, call["ignore_index"], smoothing, reduction, head.owner.gradients_in_backward)
        return ChunkedCrossEntropy.apply(rows, head.weight, head.bias, target, weight, options)

    return weighed(compute, call["reduction"], target, call["ignore_index"], weight)  # a token mean: weighed


def _vocabulary_sharded(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """A tensor-parallel head: the whole input on every rank, the weight's (and bias's) rows split over one mesh
    dim (a column-wise style)."""
    return (isinstance(input, DTensor) and isinstance(weight, DTensor) and weight.device_mesh.ndim == 1
            and input.device_mesh == weight.device_mesh and input.placements == (Replicate(),)
            and weight.placements == (Shard(0),) and weight.shape[0] % weight.device_mesh.size() == 0
            and (bias is None or (isinstance(bias, DTensor) and bias.placements == (Shard(0),))))


def materialized(output: Any) -> Any:
    """``output`` with any deferred logits in it computed whole (what a step returns leaves the step)."""
    if not any(isinstance(t, DeferredLogits) for t in tree_flatten(output)[0]):
        return output
    return tree_map(lambda t: t._whole() if isinstance(t, DeferredLogits) else t, output)


def install(module: nn.Module, name: str, styled: bool = False) -> Optional[ChunkedHeadLoss]:
    """Fuse the LM head ``name`` of ``module`` with its cross entropy (see the module docstring); None when this
    rank does not hold it (a pipeline stage before the last) or it is no plain ``nn.Linear``: a head whose
    weight is a DTensor is fused only when lightning_4d's tensor-parallel plan split it (``styled``), whose
    column-wise style passes deferred logits through; one the module's ``configure_model`` laid out keeps its
    own forward."""
    try:
        head = module.get_submodule(name)
    except AttributeError:
        return None
    if not isinstance(head, nn.Linear) or not (type(head.weight) is nn.Parameter
                                               or (styled and isinstance(head.weight, DTensor))):
        return None
    return ChunkedHeadLoss(name, head)


def whole_logits_elements(forwards_first: bool, microbatches: int) -> int:
    """Logits per micro-batch up to which a plain head runs unfused under a pipeline schedule: under one that
    runs every forward first, as many as leave all ``microbatches``' logits within one chunk's
    (``MIN_CHUNK_ELEMENTS``); otherwise none (there, the fused path computes the head once)."""
    return MIN_CHUNK_ELEMENTS // microbatches if forwards_first else 0


def describe(name: str, module: nn.Module, styled: bool, whole_elements: int = 0) -> str:
    """The start-up line: which head is fused, or why not (``whole_elements``: see
    :meth:`ChunkedHeadLoss.schedule`)."""
    try:
        weight = getattr(module.get_submodule(name), "weight", None)
    except AttributeError:  # a pipeline stage before the last: the line says what the last stage does
        weight = None
    if isinstance(weight, DTensor) and not styled:
        return (f"fuse_lm_loss: the LM head {name} is not fused: its tensor-parallel layout is the module's own"
                " (configure_model), which keeps its logits as that layout makes them.")
    sharded = ", each rank over its share of the vocabulary" if styled else ""
    small = "" if styled or not whole_elements else (
        f" Under this pipeline schedule a micro-batch's logits of at most {whole_elements:,} elements are computed"
        " whole, as without fusion: every micro-batch's together fit in one chunk, and chunks would compute the"
        " head again in backward.")
    return (f"fuse_lm_loss: the LM head {name} is fused with its cross entropy{sharded}: its logits are computed"
            " in chunks about the size of its input, never whole, when they only reach a token loss"
            f" (FourDStrategy(fuse_lm_loss=False) turns it off).{small}")


@contextmanager
def step_scope(fused: Optional[ChunkedHeadLoss], deferred: bool = True) -> Iterator[Callable[[Any], Any]]:
    """Around one step: the head defers (``deferred``), and on exit the step's deferred logits are closed; yields
    :func:`materialized` for the step's output."""
    with deferring() if fused is not None and deferred else nullcontext():
        try:
            yield materialized
        finally:
            if fused is not None:
                fused.close()
