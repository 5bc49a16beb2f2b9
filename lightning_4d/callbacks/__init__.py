"""Lightning's callbacks in every layout: prediction writers that write each sample once
(:mod:`.prediction_writers`), and weight averaging supported where its deep copy of the module works
(:mod:`.weight_averaging`)."""

from lightning_4d.callbacks.prediction_writers import PredictionWriters, attach as attach_prediction_writers
from lightning_4d.callbacks.weight_averaging import check_weight_averaging

__all__ = ["PredictionWriters", "attach_prediction_writers", "check_weight_averaging"]
