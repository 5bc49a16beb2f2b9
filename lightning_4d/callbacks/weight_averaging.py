"""Lightning's ``StochasticWeightAveraging`` deep-copies the module in its ``setup`` hook, before the strategy lays
it out, and copies the averages into it as plain tensors: that works where every rank holds whole weights (dp, cp)
and fails after the first averaging epoch where it holds shards or a stage (``aten.copy_ got mixed torch.Tensor and
DTensor``). Refused there before any process starts, as Lightning refuses it for its own sharded strategies.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging


def check_weight_averaging(callbacks: list[Any], dims: Any) -> None:
    """``dims``: the layout (:class:`~lightning_4d.parallel_dims.ParallelDims`). A ValueError naming the fix."""
    if not any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
        return
    held = [f"{name}={getattr(dims, name)}" for name in ("tp", "dp_shard", "pp", "ep") if getattr(dims, name) > 1]
    if held:
        raise ValueError(
            f"StochasticWeightAveraging with FourDStrategy({', '.join(held)}): Lightning's callback averages a copy of"
            " the module made before the strategy shards it, which cannot take this layout's sharded or cut"
            " weights. Fix: keep an exponential moving average in a callback, one tensor per parameter"
            " (`average.lerp_(p.detach(), 1 - decay)` after each batch; docs/getting_started.md, 'Weight averaging'), which"
            " works in every layout, or train with SWA under dp and cp only.")
