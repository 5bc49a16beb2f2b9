"""How a module becomes parallel, in one order: :func:`.parallelize.parallelize` applies every dimension
(plans (:mod:`.plans`), tensor and expert parallelism, activation checkpointing, compile, FSDP, materialization of meta-built
modules) and returns the :class:`.parallel_model.ParallelModel` the strategy drives every step; the FSDP units around the blocks
(:mod:`.block_units`), meta-device materialization (:mod:`.materialize`) and the agreement of weights across ranks
(:mod:`.weight_agreement`) serve it; ``FourDStrategy``'s arguments become its options in :mod:`.options`."""

__all__ = ["block_units", "materialize", "options", "parallel_model", "parallelize", "plans", "weight_agreement"]  # its modules: import them by name
