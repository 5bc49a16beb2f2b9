"""Every private name of torch, Lightning, torchmetrics and transformers that lightning-4d reaches, in one place.

A private name can change or vanish in any release without a deprecation. Reaching each one only through
this package means an upgrade breaks here, in one place, and ``tests/test_compat.py`` fails naming the symbol
instead of a parallel run going wrong somewhere else. Each entry says why no public API does the job.

One module per library reached into, so that an upgrade of one is adapted in one file: :mod:`.torch_internals`
(torch, with its meta-device helpers), :mod:`.lightning_internals` (Lightning, torchmetrics and Lightning's pair
for the random streams) and :mod:`.transformers_internals` (Hugging Face transformers, imported only where it is
called). The rest of lightning-4d imports every name from here: ``from lightning_4d import _compat as compat``.
"""

from lightning_4d._compat.torch_internals import (
    ATTENTION_KERNELS, DeviceMesh, FUNCTIONAL_COLLECTIVES, FUNCTIONAL_COLLECTIVE_NAMESPACES, LOSS_ENTRIES,
    OpOverloadPacket, OwnPlacementsStyle, PROCESS_GROUP_METHODS, SequenceParallelFromPlain, all_gather_in_stream,
    all_reduce_in_stream, all_to_all_in_stream, aten, buffers_of, children_of, copy_state_dict, default_store,
    dispatch_mode, dist, efficient_attention_cuda, efficient_attention_cuda_backward, flash_attention_cpu,
    flash_attention_cpu_backward, flash_attention_cuda, flash_attention_cuda_backward, flatten_mesh,
    fsdp_defer_backward_end, fsdp_finish_backward, fsdp_lazy_init, fsdp_reset_sharded_params,
    functional_collectives, graph_breaks, in_backward, in_flight, keystr, loss_entry, loss_parallel_ops,
    mesh_with_flattened, non_persistent_buffers, op_qualified_name, parameters_of, passing_output, process_groups,
    reduce_scatter_in_stream, reduction_code, set_children, set_loss_entry, set_tensor_hooks, tensor_hooks,
    tensor_version, tree_flatten, tree_flatten_with_path, tree_map, waited, without_function_modes,
    without_subclass_functions, wrap_index_sampler,
)
from lightning_4d._compat.lightning_internals import (
    MetricOnBatch, all_gather_ddp_if_available, count_metric_updates, fetches_inside_step, init_optimizers,
    metric_forward_cache, metric_reductions, metric_snapshot, metric_update_count,
    refuse_directories_in_load_from_checkpoint, restore_metric, rng_states, route_checkpoint_links, set_device_mesh,
    set_metric_forward_cache, set_rng_states, setup_distributed, skip_sigterm_broadcast, sync_batchnorm_requested,
    sync_ddp_if_available, train_dataloader,
)
from lightning_4d._compat.transformers_internals import (
    hf_attention_implementation, hf_balancing_loss_modules, hf_initialize_module, hf_loss_function, hf_pretrained,
    hf_reentrant_checkpointing, hf_supports_sdpa, module_function_replaced,
)

# ``dist`` and ``DeviceMesh`` are handed on too: tests/test_compat.py checks their private members through them.
__all__ = [
    "ATTENTION_KERNELS", "DeviceMesh", "FUNCTIONAL_COLLECTIVES", "FUNCTIONAL_COLLECTIVE_NAMESPACES", "LOSS_ENTRIES",
    "MetricOnBatch", "OpOverloadPacket", "OwnPlacementsStyle", "PROCESS_GROUP_METHODS", "SequenceParallelFromPlain",
    "all_gather_ddp_if_available", "all_gather_in_stream", "all_reduce_in_stream", "all_to_all_in_stream", "aten",
    "buffers_of", "children_of", "copy_state_dict", "count_metric_updates", "default_store", "dispatch_mode",
    "dist", "efficient_attention_cuda", "efficient_attention_cuda_backward", "fetches_inside_step",
    "flash_attention_cpu", "flash_attention_cpu_backward", "flash_attention_cuda", "flash_attention_cuda_backward",
    "flatten_mesh", "fsdp_defer_backward_end", "fsdp_finish_backward", "fsdp_lazy_init",
    "fsdp_reset_sharded_params", "functional_collectives", "graph_breaks", "hf_attention_implementation",
    "hf_balancing_loss_modules", "hf_initialize_module", "hf_loss_function", "hf_pretrained",
    "hf_reentrant_checkpointing", "hf_supports_sdpa", "in_backward", "init_optimizers", "in_flight", "keystr",
    "loss_entry", "loss_parallel_ops", "mesh_with_flattened", "metric_forward_cache", "metric_reductions",
    "metric_snapshot", "metric_update_count", "module_function_replaced", "non_persistent_buffers",
    "op_qualified_name", "parameters_of", "passing_output", "process_groups", "reduce_scatter_in_stream",
    "reduction_code", "refuse_directories_in_load_from_checkpoint", "restore_metric", "rng_states",
    "route_checkpoint_links", "set_children", "set_device_mesh", "set_loss_entry", "set_metric_forward_cache",
    "set_rng_states", "set_tensor_hooks", "setup_distributed", "skip_sigterm_broadcast", "sync_batchnorm_requested",
    "sync_ddp_if_available", "tensor_hooks", "tensor_version", "train_dataloader", "tree_flatten",
    "tree_flatten_with_path", "tree_map", "waited", "without_function_modes", "without_subclass_functions",
    "wrap_index_sampler",
]
