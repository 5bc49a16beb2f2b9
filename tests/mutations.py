"""Known-bad changes to the package, applied in one process for one fit (tests/test_mutations.py).

Each is a callback: constructing it (in a parity worker, before the Trainer sets the module up) monkeypatches
the package or torch in that process; its ``teardown`` undoes it, so the next case of the same launch runs the
real code. Nothing is edited on disk and the package holds no test hook.
"""

from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


def _patch(owner: Any, name: str, replacement: Any) -> Callable[[], None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    return lambda: setattr(owner, name, original)


class _Mutation(Callback):
    def __init__(self) -> None:
        self._undo = self.apply()

    def apply(self) -> Callable[[], None]:
        raise NotImplementedError

    def teardown(self, trainer, pl_module, stage):
        self._undo()


class NoDataParallelDivision(_Mutation):
    """The gradient buckets sum over the replicas and never divide by their number."""

    def apply(self):
        from lightning_4d.data_parallel.gradient_buckets import GradientBuckets

        finish = GradientBuckets._finish

        def summed(buckets, bucket):
            finish(buckets, bucket)
            bucket.flat.mul_(buckets.group_size)

        return _patch(GradientBuckets, "_finish", summed)


class DoubledLossScale(_Mutation):
    """Every token-mean loss's gradient twice what it should be (the context-parallel scaling counted twice);
    its value unchanged."""

    def apply(self):
        from lightning_4d.numerics.token_losses import TokenMeanLosses

        weigh = TokenMeanLosses.weigh

        def doubled(losses, *args, **kwargs):
            loss = weigh(losses, *args, **kwargs)
            return 2 * loss - loss.detach()

        return _patch(TokenMeanLosses, "weigh", doubled)


class DroppedMicrobatch(_Mutation):
    """The first micro-batch of every pipeline step contributes no gradient."""

    def apply(self):
        from lightning_4d.pipeline.runner import PipelineRunner

        scaled = PipelineRunner._scaled_loss
        calls = {"n": 0}

        def dropping(runner, loss, target):
            first = calls["n"] % runner.config.num_microbatches == 0
            calls["n"] += 1
            return scaled(runner, loss, target) * (0.0 if first else 1.0)

        return _patch(PipelineRunner, "_scaled_loss", dropping)


class UnreducedTokenCounts(_Mutation):
    """Token-mean losses divide by this rank's token count instead of the count over the replicas."""

    def apply(self):
        from lightning_4d.numerics import token_losses

        reduce = token_losses.compat.all_reduce_in_stream

        def local_counts(tensor, op, group):
            return tensor if tensor.numel() == 2 else reduce(tensor, op, group)  # (sum, count): not reduced

        return _patch(token_losses.compat, "all_reduce_in_stream", local_counts)


class SkippedReduceScatter(_Mutation):
    """FSDP's gradient reduce-scatter keeps this rank's own chunk instead of summing the ranks' chunks."""

    def apply(self):
        def own_chunk(output, input, group=None, op=None, async_op=False):
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            output.copy_(input.view(size, -1)[rank].view_as(output))
            return None

        return _patch(dist, "reduce_scatter_single", own_chunk)


class UnreducedReplicatedGradient(_Mutation):
    """Under tensor parallelism a replicated parameter used on sharded activations (a norm's gain under sequence
    parallelism) keeps this rank's partial gradient instead of the sum over the tp ranks."""

    def apply(self):
        from torch.distributed.tensor import DTensor

        from lightning_4d.tensor_parallel import apply

        def partial_kept(param):
            grad = param.grad
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                param.grad = DTensor.from_local(grad.to_local(), grad.device_mesh, param.placements, run_check=False)
            else:
                grad_like_param(param)

        grad_like_param = apply._grad_like_param
        return _patch(apply, "_grad_like_param", partial_kept)
