"""lightning-4d: data, tensor/sequence, context and pipeline parallelism for unchanged LightningModules.

Importing the package registers the strategy name ``"fourd"`` (``Trainer(strategy="fourd")``,
``--trainer.strategy fourd``).
"""

from lightning_4d.data_parallel import GradientBuckets
from lightning_4d.parallel_dims import ParallelDims
from lightning_4d.strategy import FourDStrategy

__all__ = ["FourDStrategy", "GradientBuckets", "ParallelDims"]
