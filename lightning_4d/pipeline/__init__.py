"""Pipeline parallelism for unchanged LightningModules (see ``docs/pipeline_parallel.md``)."""

from lightning_4d.pipeline.config import SCHEDULES, PipelineConfig
from lightning_4d.pipeline.plan import PipelinePlan, check_blocks, find_blocks
from lightning_4d.pipeline.runner import PipelineRunner

__all__ = ["SCHEDULES", "PipelineConfig", "PipelinePlan", "PipelineRunner", "check_blocks", "find_blocks"]
