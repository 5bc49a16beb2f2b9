"""Probes for the sharded data-parallel tests: how parameters are sharded and when FSDP reduce-scatters."""

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_4d.observability.telemetry import Telemetry


class ShardTrace(Callback):
    """Records each parameter's layout after setup and the batch of every reduce-scatter FSDP issues."""

    def __init__(self) -> None:
        self.layout: dict[str, dict] = {}
        self.reduce_scatters: list[int] = []
        self.dtypes: set[str] = set()  # "all_gather <dtype>", "reduce_scatter <dtype>"
        self.batch_idx = -1
        self._original = None
        self.buckets: list[str] = []

    def on_fit_start(self, trainer, pl_module):
        for name, p in pl_module.named_parameters():
            self.layout[name] = {"dtensor": isinstance(p, DTensor), "full": p.numel(),
                                 "local": p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
                                 "placements": [repr(x) for x in p.placements] if isinstance(p, DTensor) else [],
                                 "mesh": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else []}
        names = {id(p): name for name, p in pl_module.named_parameters()}
        self.buckets = sorted(names[id(p)] for b in trainer.strategy.parallel._buckets.values() for p in b.params)
        original = self._original = dist.reduce_scatter_single
        gather = self._gather = dist.all_gather_single
        probe = self

        def traced(*args, **kwargs):
            probe.reduce_scatters.append(probe.batch_idx)
            probe.dtypes.add(f"reduce_scatter {kwargs['input'].dtype}")
            return original(*args, **kwargs)

        def traced_gather(*args, **kwargs):
            probe.dtypes.add(f"all_gather {args[1].dtype}")  # (output, input, group=...)
            return gather(*args, **kwargs)

        dist.reduce_scatter_single = traced
        dist.all_gather_single = traced_gather

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_idx = batch_idx

    def on_fit_end(self, trainer, pl_module):
        dist.reduce_scatter_single = self._original
        dist.all_gather_single = self._gather

    def parity_extras(self, trainer):
        return {"layout": self.layout, "reduce_scatters": self.reduce_scatters, "buckets": self.buckets,
                "dtypes": sorted(self.dtypes), "described": trainer.strategy.parallel.describe()}


class CommLabels(Telemetry):
    """Telemetry every two optimizer steps; reports the dims it attributed communication time to."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=2)

    def parity_extras(self, trainer):
        return {"comm_labels": sorted(key.split("/")[-1] for key, value in self.last_metrics.items()
                                      if key.startswith("telemetry/comm_s/") and value > 0)}


class UnitNames(Callback):
    """The FSDP units (module names) after setup, and the sizes of the all-gathers FSDP issues inside each
    backward (wrapped from ``on_before_backward`` to ``on_after_backward`` only)."""

    def __init__(self) -> None:
        self.backward_gathers: list[list[int]] = []
        self._gather = None

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.fsdp import FSDPModule

        self.units = sorted(name for name, m in pl_module.named_modules() if isinstance(m, FSDPModule))

    def on_before_backward(self, trainer, pl_module, loss):
        gather = self._gather = dist.all_gather_single
        sizes: list[int] = []
        self.backward_gathers.append(sizes)

        def traced_gather(*args, **kwargs):
            sizes.append(args[0].numel())  # (output, input, group=...)
            return gather(*args, **kwargs)

        dist.all_gather_single = traced_gather

    def on_after_backward(self, trainer, pl_module):
        dist.all_gather_single = self._gather

    def parity_extras(self, trainer):
        return {"units": self.units, "backward_gathers": self.backward_gathers}
