"""Callbacks that observe a distributed run from inside; the harness collects their ``parity_extras``."""

import gc
import time
import weakref

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_4d.data_parallel import GradientBuckets


class GradientCommTrace(Callback):
    """Records every gradient-bucket all-reduce: at which batch, whether inside backward, which parameters."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, list[str]]] = []
        self.batch_idx = -1
        self._original = None

    def on_fit_start(self, trainer, pl_module):
        original = self._original = GradientBuckets._launch
        names = {id(p): name for name, p in pl_module.named_parameters()}
        calls, probe = self.calls, self

        def traced(buckets, bucket):
            in_backward = torch._C._current_graph_task_id() != -1
            calls.append((probe.batch_idx, in_backward, [names[id(p)] for p in bucket.params]))
            return original(buckets, bucket)

        GradientBuckets._launch = traced

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_idx = batch_idx

    def on_fit_end(self, trainer, pl_module):
        GradientBuckets._launch = self._original

    def parity_extras(self, trainer):
        return {"comm": self.calls}


class GradientStorage(Callback):
    """At every optimizer step, the address of the memory each parameter's gradient lives in."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({name: p.grad.untyped_storage().data_ptr() for name, p in pl_module.named_parameters()
                           if p.grad is not None})

    def parity_extras(self, trainer):
        return {"grad_storage": self.steps}


class BatchTrace(Callback):
    """Gathers, from every rank, a fingerprint of each training batch it received."""

    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())

    def parity_extras(self, trainer):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.seen)
        coordinates = [trainer.strategy.parallel_dims.coordinates(rank) for rank in range(dist.get_world_size())]
        return {"batches": everyone, "coordinates": coordinates}


class FailOnRank(Callback):
    """Raises inside training on one rank at one step, as a bug in user code or a data error would."""

    rank, step = 1, 3

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step} at t={time.time():.3f}")


class PerturbWeightOnRank(Callback):
    """Changes one weight on rank 1 only, before step 1: a replica silently diverging."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 1:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] += 1e-3


def rank_seeded_token_data(train: bool = True):
    """A data pipeline with a bug: it seeds itself by global rank, so tp/cp/pp peers get different samples."""
    import os

    from tests.lm_models import token_data

    generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    dataset = token_data(train)
    inputs, labels = dataset.tensors
    order = torch.randperm(len(inputs), generator=generator)
    return torch.utils.data.TensorDataset(inputs[order], labels[order])


def rank_seeded_classifier():
    """A module built without a common seed: every rank starts from different random weights. It trains with SGD
    (momentum 0.9): AdamW turns the round-off of a gradient element near its eps into a weight difference (10 of
    1,700 elements off by up to 2e-5 after 4 steps at dp=2, measured), which is not what this case checks."""
    import os

    from tests.models import Classifier

    class SGDClassifier(Classifier):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))
    return SGDClassifier()


def classifier_zeroing_in_place():
    """The classifier with ``zero_grad(set_to_none=False)``: its gradient tensors live across steps."""
    from tests.models import Classifier

    class ZeroingInPlace(Classifier):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            optimizer.zero_grad(set_to_none=False)

    return ZeroingInPlace()


class DieWhileSaving(Callback):
    """Rank 1 is killed (SIGKILL) while writing its shard of the second checkpoint written (``last.ckpt`` of the
    same step shares the first one's files): half a file on disk. Under ``async_save`` the write, and the kill,
    happen in the background writer while training goes on (the writer process's pid is printed: it must die
    with its rank)."""

    def on_fit_start(self, trainer, pl_module):
        if trainer.global_rank != 1:
            return
        import itertools
        import os
        import signal
        import threading
        from pathlib import Path

        from torch.distributed.checkpoint import FileSystemWriter

        from lightning_4d.checkpoint.writer_process import ProcessFileWriter

        saves = itertools.count(1)

        def dying(original):
            def write_data(writer, plan, planner):
                if next(saves) == 2:
                    (Path(writer.path) / "__1_0.distcp").write_bytes(b"\0" * 1000)
                    process = getattr(writer, "writer_process", None)
                    print(f"killing rank 1 while it writes {writer.path} (thread: {threading.current_thread().name})"
                          + (f" (writer process: {process.process.pid})" if process else ""), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(writer, plan, planner)
            return write_data

        FileSystemWriter.write_data = dying(FileSystemWriter.write_data)
        ProcessFileWriter.write_data = dying(ProcessFileWriter.write_data)


class GradientLifetimeProbe(Callback):
    """Whether the gradients of the previous accumulation window are still alive when Lightning zeroes them
    after the next window's first training_step: gradients alive there were held through that step's forward
    next to the activations (under pipelining, next to the new gradients during the whole schedule)."""

    def __init__(self) -> None:
        self.previous: list = []
        self.alive_at_zero_grad: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.previous = [weakref.ref(p.grad) for p in pl_module.parameters() if p.grad is not None]

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        gc.collect()
        if self.previous:
            self.alive_at_zero_grad.append(sum(ref() is not None for ref in self.previous))

    def parity_extras(self, trainer):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.alive_at_zero_grad)
        return {"alive_at_zero_grad": everyone}


class PredictionWrites(Callback):
    """After fit, predicts 16 validation sequences with a ``BasePredictionWriter`` (batch interval) that records, on
    every rank, the sample indices it was asked to write; returns every rank's records (rank 0 reads them)."""

    def parity_extras(self, trainer):
        import json
        import tempfile
        from pathlib import Path

        from lightning.pytorch.callbacks import BasePredictionWriter
        from torch.utils.data import DataLoader

        from tests.lm_models import token_data

        folder = Path(trainer.strategy.broadcast(tempfile.mkdtemp() if trainer.global_rank == 0 else None))

        class Writer(BasePredictionWriter):
            def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,
                                   dataloader_idx):
                with open(folder / f"rank{trainer.global_rank}.jsonl", "a") as out:
                    out.write(json.dumps({"indices": list(batch_indices), "rows": len(prediction)}) + "\n")

        writer = Writer(write_interval="batch")
        trainer.callbacks.append(writer)
        data = token_data(train=False)
        trainer.predict(trainer.lightning_module, DataLoader(data, batch_size=4), return_predictions=False)
        trainer.callbacks.remove(writer)
        trainer.strategy.barrier()
        written = {path.stem: [json.loads(line) for line in path.read_text().splitlines()]
                   for path in sorted(folder.glob("rank*.jsonl"))}
        return {"written": written, "samples": len(data)}


def _run_key():
    """The name of this run's keys in the rendezvous store (lightning_4d.parallel_dims.begin_run_keys), or None."""
    from lightning_4d._compat import default_store
    from lightning_4d.parallel_dims import RUN_KEY

    store = default_store()
    return store.get(RUN_KEY).decode() if store is not None and store.check([RUN_KEY]) else None


class ChosenLayout(Callback):
    """The layout ``layout="auto"`` chose, as every rank holds it (``parity_extras``: the sizes, and each rank's),
    and whether the strategy's set-up, where the choice and its trials run, left torch's random state as it was and
    the name of this run's keys in the store (the heartbeats started under it in the callbacks' ``setup``)."""

    def setup(self, trainer, pl_module, stage):
        self.before, self.run_key = torch.get_rng_state(), _run_key()  # the heartbeats' keys are named by now

    def on_fit_start(self, trainer, pl_module):
        self.random_state_kept = bool(torch.equal(self.before, torch.get_rng_state()))
        self.run_key_kept = self.run_key is not None and self.run_key == _run_key()

    def parity_extras(self, trainer):
        import torch.distributed as dist

        strategy = trainer.strategy
        sizes = {name: strategy.requested_sizes[name] for name in ("dp", "dp_shard", "pp", "cp", "tp")}
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, sizes)
        return {"chosen": {**sizes, "every_rank": every_rank, "random_state_kept": self.random_state_kept,
                           "run_key_kept": self.run_key_kept,
                           "activation_checkpointing": strategy.composition["activation_checkpointing"].mode}}
