"""Pipeline parallelism for unchanged LightningModules (see ``docs/pipeline_parallel.md``)."""

from lightning_4d.pipeline.config import SCHEDULES, PipelineConfig
from lightning_4d.pipeline.runner import PipelineRunner
from lightning_4d.pipeline.split import check_blocks, check_splittable, find_blocks

__all__ = ["SCHEDULES", "PipelineConfig", "PipelineRunner", "check_blocks", "check_splittable", "find_blocks"]
