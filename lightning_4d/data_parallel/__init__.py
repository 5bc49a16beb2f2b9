"""Data parallelism over dp (and cp, whose ranks hold the same weights): replicated DP averages gradients
with bucketed all-reduces launched during backward (:mod:`.gradient_buckets`); sharded DP (``dp_shard``, HSDP)
puts FSDP2 units on the blocks and the root (:mod:`.fsdp`)."""

from lightning_4d.data_parallel.fsdp import (ReshardAfterForward, ShardedUnits, apply_sharding, block_reshard,
                                             check_own_units, check_reshard_after_forward, check_shard_units, gathered,
                                             mixed_precision_policy, own_unit_params, own_units, param_dtype_for)
from lightning_4d.data_parallel.gradient_buckets import DEFAULT_BUCKET_MB, BucketSets, GradientBuckets

__all__ = ["DEFAULT_BUCKET_MB", "BucketSets", "GradientBuckets", "ReshardAfterForward", "ShardedUnits", "apply_sharding",
           "block_reshard", "check_own_units", "check_reshard_after_forward", "check_shard_units",
           "gathered", "mixed_precision_policy", "own_unit_params", "own_units", "param_dtype_for"]
