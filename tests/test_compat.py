"""The private torch / Lightning / torchmetrics names lightning-4d depends on still exist and behave as used,
and no module outside ``lightning_4d/_compat/`` reaches one. An upgrade that breaks one fails here, by name."""

import re
import tokenize
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader

from lightning_4d import _compat as compat

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_4d"
COMPAT = PACKAGE / "_compat"  # the one place that may reach private names


def _attention_inputs():
    torch.manual_seed(0)
    return [torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3)]


def _flash_cpu_matches_sdpa():
    q, k, v = _attention_inputs()
    out, lse = compat.flash_attention_cpu(q, k, v, 0.0, True, scale=None)[:2]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    grads = compat.flash_attention_cpu_backward(torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=None)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def _module_registries():
    module = nn.Linear(2, 2)
    assert compat.children_of(nn.Sequential(module))["0"] is module
    assert compat.parameters_of(module)["weight"] is module.weight
    module.register_buffer("table", torch.zeros(2))
    assert compat.buffers_of(module)["table"] is module.table
    container = nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1)])
    compat.set_children(container, OrderedDict(list(compat.children_of(container).items())[:1]))
    assert len(container) == 1



def _metric_snapshot():
    metric = torchmetrics.MeanMetric()
    metric(torch.tensor(3.0))
    saved = compat.metric_snapshot(metric)
    metric(torch.tensor(5.0))
    compat.restore_metric(metric, saved)
    assert compat.metric_update_count(metric) == 1 and float(metric.compute()) == 3.0
    cat = torchmetrics.CatMetric()
    cat(torch.tensor([1.0]))
    saved = compat.metric_snapshot(cat)
    cat(torch.tensor([2.0]))
    compat.restore_metric(cat, saved)
    assert cat.compute().reshape(-1).tolist() == [1.0]


def _metric_on_batch():
    metric = torchmetrics.MeanMetric()
    metric(torch.tensor(1.0))
    batch = compat.MetricOnBatch(metric)
    batch.update(torch.tensor(3.0))
    batch.update(torch.tensor(5.0))
    assert float(batch.compute()) == 4.0 and float(metric.compute()) == 1.0
    batch.reset()
    batch.update(torch.tensor(7.0))
    assert float(batch.compute()) == 7.0


def _rng_states():
    saved = compat.rng_states()
    first = torch.rand(3)
    compat.set_rng_states(saved)
    assert torch.equal(torch.rand(3), first)


def _index_sampler():
    class Skipping(DataLoader):
        pass

    compat.wrap_index_sampler(Skipping, lambda loader, sampler: list(sampler)[1:])
    assert [b.tolist() for b in Skipping(torch.arange(6), batch_size=2)] == [[2, 3], [4, 5]]


def _metric_internals():
    metric = torchmetrics.MeanMetric()
    metric(torch.tensor(3.0))
    assert compat.metric_update_count(metric) == 1 and float(compat.metric_forward_cache(metric)) == 3.0
    compat.count_metric_updates(metric, 2)
    compat.set_metric_forward_cache(metric, torch.tensor(5.0))
    assert compat.metric_update_count(metric) == 3 and float(compat.metric_forward_cache(metric)) == 5.0


def _tensor_version():
    mask = torch.zeros(2)
    before = compat.tensor_version(mask)
    mask.add_(1)
    assert compat.tensor_version(mask) == before + 1


def _in_backward():
    seen = []
    weight = torch.ones(2, requires_grad=True)
    out = weight * 2
    out.register_hook(lambda grad: seen.append(compat.in_backward()))
    out.sum().backward()
    assert seen == [True] and not compat.in_backward()


def _pytree_and_ops():
    leaves, _ = compat.tree_flatten_with_path({"a": [torch.zeros(1)]})
    assert compat.keystr(leaves[0][0]) == "['a'][0]"
    assert compat.tree_map(lambda t: t + 1, [torch.zeros(1)])[0].item() == 1
    assert type(torch.ops.aten.mm) is compat.OpOverloadPacket
    assert compat.op_qualified_name(torch.ops.aten.mm) == "aten::mm"
    assert torch.distributed.ProcessGroup  # the methods are looked up on it at telemetry start


def _parallel_style_hooks():
    import inspect

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    for style in (ColwiseParallel, RowwiseParallel):
        assert list(inspect.signature(style._apply).parameters) == ["self", "module", "device_mesh"]
        for name in ("_prepare_input_fn", "_prepare_output_fn"):
            assert callable(getattr(style, name)), name
    assert list(inspect.signature(SequenceParallel._prepare_input_fn).parameters) == [
        "sequence_sharding", "mod", "inputs", "device_mesh"]
    for attribute in ("input_layouts", "desired_input_layouts", "output_layouts", "use_local_output", "src_data_rank"):
        assert hasattr(ColwiseParallel(), attribute), attribute


def _fsdp_internals():
    # What compat.fsdp_lazy_init / fsdp_finish_backward reach (the pipelined dp_shard tests run them for real).
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    state = FSDPState()
    return (fully_shard.state, state._state_ctx.all_states, state._fsdp_param_groups, state._lazy_init,
            state._root_post_backward_final_callback, FSDPParamGroup.post_backward)


def _hf_loss_function():
    # What context parallelism reads to decide that a model shifts its labels= itself (shift_labels in its loss).
    import inspect

    import transformers

    config = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2)
    loss = compat.hf_loss_function(transformers.GPT2LMHeadModel(config))  # loss_type unset: HF's fallback
    assert "shift_labels" in inspect.signature(loss).parameters
    model = transformers.GPT2LMHeadModel(config)
    model.loss_function = len  # HF's setter keeps it on the instance
    assert compat.hf_loss_function(model) is len


def _hf_attention():
    # What context parallelism's refusal of Hugging Face 'eager' attention reads (tests/test_zoo.py: Bloom).
    import transformers

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2)
    for implementation in ("eager", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
        assert compat.hf_attention_implementation(model) == implementation
    assert compat.hf_supports_sdpa(model) and not compat.hf_supports_sdpa(transformers.BloomForCausalLM)
    assert compat.hf_attention_implementation(nn.Linear(1, 1)) is None


def _hf_reentrant_checkpointing():
    # What the pipeline's refusal of a layer's own reentrant checkpoint reads (tests/test_activation_checkpointing).
    import transformers

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    assert not compat.hf_reentrant_checkpointing(layer)
    for kwargs, reentrant in (({"use_reentrant": False}, False), ({"use_reentrant": True}, True), ({}, True)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # {}: torch's default, reentrant
        assert compat.hf_reentrant_checkpointing(layer) is reentrant, kwargs
    model.gradient_checkpointing_enable()  # Hugging Face's default: non-reentrant
    assert not compat.hf_reentrant_checkpointing(layer)


def _meta_materialization():
    # What lightning_4d.composition.materialize reaches: the non-persistent buffer names, a tensor's hooks (attached again
    # after swap_tensors), torch's dispatch mode base class, FSDP's re-padding of a sharded parameter.
    module = nn.Linear(2, 2)
    module.register_buffer("table", torch.zeros(2), persistent=False)
    assert compat.non_persistent_buffers(module) == {"table"}
    hook, post = (lambda grad: grad), (lambda param: None)
    module.weight.register_hook(hook)
    module.weight.register_post_accumulate_grad_hook(post)
    hooks = compat.tensor_hooks(module.weight)
    assert list(hooks[0].values()) == [hook] and list(hooks[1].values()) == [post]
    assert compat.tensor_hooks(module.bias) == (None, None)
    seen = []
    bias_hooks = ({0: lambda grad: seen.append("backward") or grad}, {0: lambda param: seen.append("post")})
    compat.set_tensor_hooks(module.bias, bias_hooks)
    module(torch.ones(2)).sum().backward()
    assert seen == ["backward", "post"]
    seen = []

    class Seen(compat.dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.overloadpacket.__name__, torch.Tag.nondeterministic_seeded in func.tags))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.zeros(2).normal_()
    assert ("normal_", True) in seen
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    assert callable(FSDPParam.reset_sharded_param)


def _hf_initialization():
    # What lightning_4d.composition.materialize calls for a module of a transformers model: _init_weights, with the
    # _is_hf_initialized flags cleared (transformers sets them while building, on the meta device too).
    import transformers

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, initializer_range=0.5)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert compat.hf_pretrained(model) and not compat.hf_pretrained(nn.Linear(1, 1))
    linear = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        linear.weight.zero_()
    linear._is_hf_initialized = True
    linear.weight._is_hf_initialized = True
    compat.hf_initialize_module(model, linear)
    assert linear.weight.std() > 0.1
    rotary = model.model.rotary_emb
    expected = rotary.inv_freq.clone()
    rotary.inv_freq.fill_(float("nan"))
    compat.hf_initialize_module(model, rotary)
    assert torch.equal(rotary.inv_freq, expected)


def _nested_loss_parallel():
    """Inside the user's loss_parallel() ours adds nothing and removes nothing; alone it installs the ops."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    handlers = DTensor._op_dispatcher._custom_op_handlers
    log_softmax = torch.ops.aten._log_softmax.default
    assert log_softmax not in handlers
    with loss_parallel():
        with compat.loss_parallel_ops():
            assert log_softmax in handlers
        assert log_softmax in handlers  # the user's still active after ours
    assert log_softmax not in handlers
    with compat.loss_parallel_ops():
        assert log_softmax in handlers
    assert log_softmax not in handlers


def _sigterm_broadcast():
    import lightning.pytorch as pl

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    loop = trainer.fit_loop.epoch_loop
    undo = compat.skip_sigterm_broadcast(trainer)
    assert loop._broadcast_sigterm_tensor() is None and "_broadcast_sigterm_tensor" in loop.__dict__
    undo()
    assert "_broadcast_sigterm_tensor" not in loop.__dict__ and callable(loop._broadcast_sigterm_tensor)


def _train_dataloader():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(4)), batch_size=2)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer._data_connector.attach_data(pl.LightningModule(), train_dataloaders=loader)
    assert compat.train_dataloader(trainer) is loader



def _init_optimizers():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def configure_optimizers(self):
            return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1)}

    module = Module()
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)  # as Lightning's fit attaches it
    module.trainer = trainer
    (optimizer,) = compat.init_optimizers(module)
    assert isinstance(optimizer, torch.optim.SGD)

CHECKS = {
    "nn.Module._non_persistent_buffers_set, Tensor._backward_hooks/_post_accumulate_grad_hooks,"
    " torch.utils._python_dispatch.TorchDispatchMode, FSDPParam.reset_sharded_param": _meta_materialization,
    "transformers PreTrainedModel._init_weights, _is_hf_initialized": _hf_initialization,
    "torch ParallelStyle._apply/_prepare_input_fn/_prepare_output_fn": _parallel_style_hooks,
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(+_backward)": _flash_cpu_matches_sdpa,
    "torch.ops.aten CUDA attention kernels (flash, efficient)": lambda: [
        op.default for op in (compat.flash_attention_cuda, compat.flash_attention_cuda_backward,
                              compat.efficient_attention_cuda, compat.efficient_attention_cuda_backward)],
    "nn.Module._modules/_parameters/_buffers": _module_registries,
    "Tensor._version": _tensor_version,
    "torch._C._current_graph_task_id": _in_backward,
    "DataLoader._index_sampler": _index_sampler,
    "torchmetrics Metric._update_count/_forward_cache/_computed": _metric_internals,
    "torchmetrics Metric._defaults (saved and restored by the cp step check)": _metric_snapshot,
    "lightning.fabric _collect_rng_states/_set_rng_states": _rng_states,
    "torchmetrics Metric._defaults and its class's own update/compute (a metric's step value under pp)":
        _metric_on_batch,
    "torch.utils._pytree, torch._ops.OpOverloadPacket._qualified_op_name": _pytree_and_ops,
    "torch.distributed.device_mesh.DeviceMesh._flatten": lambda: compat.DeviceMesh._flatten,
    "torch.distributed.distributed_c10d._get_default_store": lambda: compat.dist.distributed_c10d._get_default_store,
    "ProcessGroup methods telemetry wraps": lambda: [
        getattr(torch.distributed.ProcessGroup, name) for name in compat.PROCESS_GROUP_METHODS
        if name not in ("allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "recv_anysource",
                        "monitored_barrier", "_end_coalescing")],
    "torch.distributed._functional_collectives functions the collective recorder wraps (with a group argument)":
        lambda: [__import__("inspect").signature(getattr(compat.functional_collectives(), name)).parameters["group"]
                 for name in compat.FUNCTIONAL_COLLECTIVES],
    "FSDP2 state: _lazy_init, _state_ctx.all_states, _fsdp_param_groups, post_backward, the final callback":
        _fsdp_internals,
    "transformers PreTrainedModel._supports_sdpa, PretrainedConfig._attn_implementation": _hf_attention,
    "transformers PreTrainedModel._loss_function, loss_utils.LOSS_MAPPING": _hf_loss_function,
    "transformers GradientCheckpointingLayer._gradient_checkpointing_func": _hf_reentrant_checkpointing,
    "DTensor._op_dispatcher._custom_op_handlers (loss_parallel nested in a user's own)": _nested_loss_parallel,
    "torch._C.DisableTorchFunction (sdpa_operands's meta check)": lambda: compat.without_function_modes().__enter__,
    "torch.distributed.distributed_c10d._world.pg_map": lambda: compat.dist.distributed_c10d._world.pg_map,
    "lightning ModelParallelStrategy._setup_distributed/_device_mesh": lambda: (
        compat_lightning_strategy()._setup_distributed, compat_lightning_strategy().device_mesh),
    "lightning ModelParallelStrategy._timeout/_get_process_group_backend (a torchrun attempt's own store)":
        lambda: (compat_lightning_strategy()._timeout.total_seconds(),
                 compat_lightning_strategy()._get_process_group_backend),
    "lightning _TrainingEpochLoop._broadcast_sigterm_tensor (skipped while FaultTolerance holds SIGTERM)":
        _sigterm_broadcast,
    "lightning _request_dataloader, _FitLoop._data_source (layout=\"auto\" reads the first batch)": _train_dataloader,
    "lightning _init_optimizers_and_lr_schedulers (layout_trials steps a copy of the module)": _init_optimizers,
    "lightning.fabric _sync_ddp_if_available/_all_gather_ddp_if_available": lambda: (
        # called as FourDStrategy.reduce calls it (torch 2.14 refuses op=None once a process group exists)
        compat.sync_ddp_if_available(torch.tensor(1.0), reduce_op="mean"),
        compat.all_gather_ddp_if_available(torch.tensor(1.0))),
}


def compat_lightning_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy()
    compat.set_device_mesh(strategy, "a mesh")
    return strategy


@pytest.mark.parametrize("symbol", list(CHECKS))
def test_private_name_still_works(symbol):
    try:
        CHECKS[symbol]()
    except (AttributeError, TypeError, RuntimeError, AssertionError) as error:
        pytest.fail(f"{symbol} changed in torch {torch.__version__}: {type(error).__name__}: {error}."
                    " Adapt lightning_4d/_compat/.")


# Private names of torch, Lightning and torchmetrics found in lightning_4d (an attribute or import starting
# with "_" on one of their objects); our own private names are not theirs.
PRIVATE = re.compile(
    r"torch\.(?:[a-z]\w*\.)*_[a-zA-Z]|from (?:torch|lightning|torchmetrics)(?:\.[\w.]*)? import .*\b_[a-z]|"
    r"\._(?:modules|parameters|buffers|update_count|forward_cache|computed|index_sampler|flatten|get_default_store|"
    r"setup_distributed|device_mesh|qualified_op_name|timeout|apply|prepare_input_fn|prepare_output_fn|version|"
    r"optimizer)\b|\b_(?:sync|all_gather)_ddp_if_available\b|"
    r"def _(?:apply|prepare_input_fn|prepare_output_fn)\b")


def _code_lines(path: Path) -> dict[int, str]:
    """Each line's code without its strings and comments (a docstring may name a private symbol)."""
    lines: dict[int, str] = {}
    with path.open("rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.ENCODING):
                lines[token.start[0]] = lines.get(token.start[0], "") + token.string + " "
    return lines


def test_no_private_name_outside_compat():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        for number, code in _code_lines(path).items():
            if PRIVATE.search(code.replace(" . ", ".").replace(" .", ".").replace(". ", ".")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {code}")
    assert not found, "private torch/Lightning names outside lightning_4d/_compat/:\n" + "\n".join(found)


def test_the_check_finds_a_private_name():
    assert PRIVATE.search("store = dist.distributed_c10d._get_default_store()")
    assert PRIVATE.search("from torch.utils._pytree import tree_map")
    assert PRIVATE.search("out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q)")
    assert not PRIVATE.search("self._pipeline = None")
