"""``FourDStrategy``'s arguments made into the composition's options: the per-dimension configs and the keyword
arguments :func:`~lightning_4d.composition.parallelize.parallelize` takes. Each is checked alone and against the
others when the strategy is built, so that a bad one fails in the launching process, before any other starts;
the layout is checked against the module and the Trainer's callbacks before its process groups exist."""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning_4d.arguments import positive
from lightning_4d.callbacks import check_weight_averaging
from lightning_4d.composition.parallelize import check_before_launch
from lightning_4d.context_parallel import ContextParallelConfig
from lightning_4d.data_parallel import check_reshard_after_forward, check_shard_units
from lightning_4d.memory.activation_checkpointing import ActivationCheckpointConfig
from lightning_4d.memory.compile import CompileConfig
from lightning_4d.numerics.token_losses import check_normalization
from lightning_4d.parallel_dims import ParallelDims, check_ep_size
from lightning_4d.pipeline import PipelineConfig
from lightning_4d.tensor_parallel import TensorParallelConfig


def composition_options(
    sizes: dict[str, Any], *, bucket_mb: float, reshard_after_forward: Union[bool, str],
    reduce_scatter_every_batch: bool, shard_units: str, loss_normalization: str, fuse_lm_loss: bool,
    cp_comm: str, cp_seq_dim: int, cp_batch_keys: Optional[list[Union[str, int]]],
    cp_position_modules: Optional[list[str]], cp_buffers: Optional[list[str]], cp_document_key: Optional[str],
    cp_check: bool, cp_check_tokens: int, pp_schedule: str, pp_microbatches: Optional[int], pp_blocks: Optional[str],
    pp_split_points: Optional[list[int]], pp_virtual_stages: Optional[int], tp_plan: Union[str, dict, None],
    sequence_parallel: bool, tp_self_check: bool, tp_strict: bool, loss_parallel: bool,
    activation_checkpointing: str, activation_checkpointing_every: int, compile: Union[bool, dict],
) -> dict[str, Any]:
    """The options ``parallelize`` takes, from the strategy's arguments (named as ``FourDStrategy`` names them) and
    its requested ``sizes``; raises a ValueError naming the argument that is wrong."""
    positive("bucket_mb", bucket_mb, "megabytes (default 25)")
    ParallelDims.check_sizes(sizes["dp"], sizes["pp"], sizes["cp"], sizes["tp"], sizes["dp_shard"])
    check_ep_size(sizes["ep"])
    check_reshard_after_forward(reshard_after_forward)
    check_normalization(loss_normalization)
    if not isinstance(fuse_lm_loss, bool):
        raise ValueError(f"fuse_lm_loss={fuse_lm_loss!r}: use True (the LM head's cross entropy computed in chunks,"
                         " its logits never whole) or False (the head's logits computed whole, as the module"
                         " computes them).")
    context = ContextParallelConfig(sizes["cp"], cp_comm, cp_seq_dim, cp_batch_keys, cp_position_modules, cp_buffers,
                                    cp_document_key, cp_check, cp_check_tokens)
    pipeline = PipelineConfig(sizes["pp"], pp_schedule, pp_microbatches, pp_blocks, pp_split_points,
                              pp_virtual_stages)
    tensor = TensorParallelConfig(sizes["tp"], tp_plan, sequence_parallel, loss_parallel, tp_self_check, tp_strict)
    tensor.check_with_pipeline(pipeline.pp)
    compile_config = CompileConfig.build(compile)
    check_shard_units(shard_units, pipeline.pp, tensor.tp, compile_config.enabled)
    return dict(pipeline=pipeline, tensor=tensor, context=context,
                activation_checkpointing=ActivationCheckpointConfig(activation_checkpointing,
                                                                    activation_checkpointing_every),
                compile=compile_config, bucket_mb=float(bucket_mb), shard_units=shard_units,
                reshard_after_forward=reshard_after_forward, loss_normalization=loss_normalization,
                fuse_lm_loss=fuse_lm_loss, reduce_scatter_every_batch=bool(reduce_scatter_every_batch))


def check_layout(strategy: Any, user_parallelized: bool) -> None:
    """Before the layout's process groups, on every rank: the strategy's module refused by the pipeline's cut,
    sharding or expert parallelism (:func:`~lightning_4d.composition.parallelize.check_before_launch`), or a
    weight-averaging callback the layout cannot run. ``user_parallelized``: the module's ``configure_model`` lays
    it out itself."""
    module, dims = strategy.lightning_module, strategy.parallel_dims
    check_before_launch(module, dims, pipeline=strategy.pp_config, tensor=strategy.tp_config,
                        user_parallelized=user_parallelized)
    check_weight_averaging(module.trainer.callbacks, dims)
