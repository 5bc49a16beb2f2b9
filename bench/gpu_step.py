"""One GPU: does a steady-state step ever make the GPU wait for the host, and what a ~1B Llama trains at.

    python bench/gpu_step.py sync [--accelerator gpu]       # host syncs per step, FourDStrategy() and auto
    python bench/gpu_step.py llama [--steps 25] [--tiny]    # tokens/s and MFU, FourD against SingleDevice
    python bench/gpu_step.py collectives                     # the per-step agreement and exchanges, on NCCL

``sync``: the example GPT and a small Hugging Face Llama with masked labels (token-mean losses on) train 10
steps under ``FourDStrategy()`` and under Lightning's own strategy (``auto``: SingleDeviceStrategy). Steps 3 to
8 (none a logging step) run under ``torch.cuda.set_sync_debug_mode("warn")``; every warning is attributed to
the innermost frame outside torch (lightning_4d, Lightning, or this script). Then, where Lightning's own step
raised none, FourD's steps run again under ``"error"``, where any host sync raises. On a machine without CUDA
the sync debug mode does not exist: the command says so and exits 2.

``llama``: a Hugging Face Llama of about 1.0B parameters (hidden 2048, 20 layers, 32 heads of 64, 8 KV heads,
vocabulary 32000), batches of 4 x 2048 tokens, bf16-mixed, AdamW, full activation checkpointing of every
decoder layer, eager and with ``torch.compile`` per layer: ``FourDStrategy(activation_checkpointing="full",
compile=...)`` against the same module under SingleDeviceStrategy, checkpoint_wrapper and ``torch.compile``
applied per layer by hand in ``configure_model``. Each run is its own process. Step time is the median of the
steps after the fifth, CUDA synchronized around each step; MFU counts 6 x parameters + attention (12 x layers x
hidden x sequence) FLOPs per token against 989 TFLOP/s (bf16 dense, H100/H200 SXM), not the recomputation.
``collectives``: what lightning_4d issues per step on more than one rank, on one NCCL rank (one GPU): the step
agreement, a stream-ordered all-reduce and the pipeline's results exchange, each 20 times between matrix
products that keep the GPU busy, under ``set_sync_debug_mode("error")``; the host time of the loop against the
time until the GPU finished shows whether the host ran ahead.

``--tiny`` runs a 2-layer, 64-wide Llama on whatever device there is (a smoke test of this script).

Prints ``RESULT {json}`` lines; ``--out`` writes them as one JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402

PEAK_BF16_FLOPS = 989e12
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                num_attention_heads=32, num_key_value_heads=8)
LLAMA_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def _origin(stack: list) -> str:
    """Who asked: the innermost frame outside torch, as ``package:file:line``."""
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "warnings.py" in path or path.endswith("gpu_step.py") and frame.name == "_record":
            continue
        for package in ("lightning_4d", "lightning", "transformers"):
            if f"/{package}/" in path:
                return f"{package}:{path.rsplit(f'/{package}/', 1)[1]}:{frame.lineno}"
        return f"other:{os.path.basename(path)}:{frame.lineno}"
    return "unknown"


class SyncWatch(pl.Callback):
    """Steps ``first``..``last`` (0-based) under a sync debug mode; what each warning's origin was."""

    def __init__(self, mode: str, first: int = 3, last: int = 8) -> None:
        self.mode, self.first, self.last = mode, first, last
        self.seen: dict[str, int] = {}
        self.stacks: dict[str, list[str]] = {}
        self._shown = None

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            stack = traceback.extract_stack()
            where = _origin(stack)
            self.seen[where] = self.seen.get(where, 0) + 1
            if where not in self.stacks:  # the innermost frames, torch's included: which op it was
                self.stacks[where] = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}: {f.line}"
                                      for f in stack[-8:-1]]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first <= batch_idx <= self.last:
            self._shown = warnings.showwarning
            warnings.showwarning = self._record
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first <= batch_idx <= self.last:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._shown


class LlamaLM(pl.LightningModule):
    """A Hugging Face Llama trained on next tokens with ``labels=`` (its own token-mean loss)."""

    def __init__(self, config: dict, by_hand: str = "", masked: bool = False) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        self.model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa", use_cache=False))
        self.by_hand, self.masked = by_hand, masked

    def configure_model(self) -> None:
        """SingleDeviceStrategy's counterpart of FourD's options: checkpoint and compile each layer by hand."""
        if not self.by_hand:
            return
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        layers = self.model.model.layers
        for i, layer in enumerate(layers):
            layer = checkpoint_wrapper(layer) if "ac" in self.by_hand else layer
            layers[i] = torch.compile(layer) if "compile" in self.by_hand else layer

    def training_step(self, batch, batch_idx):
        x, _ = batch  # Hugging Face shifts the labels itself
        labels = x.masked_fill(x % 7 == 0, -100) if self.masked else x
        loss = self.model(input_ids=x, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _tokens(count: int, seq: int, vocab: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (count, seq + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (inputs, next tokens): what the example GPT takes


def _trainer(strategy, accelerator: str, steps: int, callbacks: list, precision: str = "32-true") -> pl.Trainer:
    return pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=50,
                      precision=precision)


def sync(accelerator: str) -> list[dict]:
    """Host syncs per steady-state step, by origin, for each model and strategy."""
    from lightning_4d.demos.gpt import GPT
    results = []
    models = {"gpt": lambda: GPT(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64),
              "hf_llama_masked": lambda: LlamaLM(LLAMA_TINY, masked=True)}
    for name, build in models.items():
        counts, stacks = {}, {}
        for strategy in ("auto", "fourd"):
            torch.manual_seed(0)
            watch = SyncWatch("warn")
            _trainer(FourDStrategy() if strategy == "fourd" else "auto", accelerator, 10, [watch]).fit(
                build(), DataLoader(_tokens(40, 64, 128), batch_size=4))
            counts[strategy] = watch.seen
            stacks.update(watch.stacks)
        torch.manual_seed(0)
        try:  # any host sync in steps 3-8 raises
            _trainer(FourDStrategy(), accelerator, 10, [SyncWatch("error")]).fit(
                build(), DataLoader(_tokens(40, 64, 128), batch_size=4))
            checked = "no error"
        except RuntimeError as error:
            checked = f"raised: {str(error)[:300]} at {_origin(traceback.extract_tb(error.__traceback__))}"
        per_step = {k: {where: n / 6 for where, n in v.items()} for k, v in counts.items()}
        results.append(dict(kind="sync", model=name, syncs_per_step=per_step, error_mode=checked, stacks=stacks,
                            lightning_4d=sum(n for where, n in counts["fourd"].items()
                                             if where.startswith("lightning_4d:"))))
    return results


def collectives() -> list[dict]:
    """lightning_4d's per-step collectives on CUDA (one NCCL rank): the step agreement (pinned staging, an
    event), a stream-ordered all-reduce, and the pipeline's results exchange, each 20 times between matrix
    products that keep the GPU busy, under ``set_sync_debug_mode("error")``."""
    import torch.distributed as dist
    from lightning_4d import _compat as compat
    from lightning_4d.faults.agreement import StepAgreement
    from lightning_4d.pipeline.results import ResultExchange

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    agreement = StepAgreement(None, device)
    exchange = ResultExchange(dist.group.WORLD, 0, device)
    a = torch.randn(4096, 4096, device=device)
    results, error = [], None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    start = time.perf_counter()
    try:
        for step in range(20):
            agreement.start([step % 2, 0, 1])
            for _ in range(4):
                a = torch.tanh(a @ a)
            reduced = compat.all_reduce_in_stream(a.sum().reshape(1), "sum", dist.group.WORLD)
            output = exchange.exchange(({"loss": reduced * 0}, {"train_loss": (a.mean(), {"on_step": True})}))
            results.append(agreement.result())
        host = time.perf_counter() - start
    except RuntimeError as failure:
        error, host = f"{failure} at {_origin(traceback.extract_tb(failure.__traceback__))}", float("nan")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    device_done = time.perf_counter() - start
    dist.destroy_process_group()
    return [dict(kind="collectives", error=error, agreements=results[:3], output_type=type(output).__name__
                 if error is None else None, host_s=host, device_s=device_done)]


class Clock(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args) -> None:
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def llama_run(strategy: str, compiled: bool, steps: int, tiny: bool) -> dict:
    """One run in this process."""
    config = LLAMA_TINY if tiny else LLAMA_1B
    batch, seq = (2, 64) if tiny else (4, 2048)
    torch.manual_seed(0)
    by_hand = "ac" + ("+compile" if compiled else "") if strategy == "single" else ""
    module = LlamaLM(config, by_hand=by_hand)
    params = sum(p.numel() for p in module.parameters())
    clock = Clock()
    plan = (FourDStrategy(activation_checkpointing="full", compile=compiled) if strategy == "fourd" else "auto")
    trainer = _trainer(plan, "gpu", steps, [clock], precision="bf16-mixed")
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, DataLoader(_tokens(batch * (steps + 1), seq, config["vocab_size"]), batch_size=batch,
                                   pin_memory=True))
    kept = sorted(clock.times[5:])
    median = kept[len(kept) // 2]
    tokens = batch * seq
    flops_per_token = 6 * params + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq
    return dict(kind="llama", strategy=strategy, compile=compiled, params=params, tokens_per_step=tokens,
                steps=len(clock.times), median_step_ms=1e3 * median, mean_step_ms=1e3 * sum(kept) / len(kept),
                min_step_ms=1e3 * kept[0], first_step_s=clock.times[0], fit_s=time.perf_counter() - start,
                tokens_per_s=tokens / median, mfu=flops_per_token * tokens / median / PEAK_BF16_FLOPS,
                max_memory_GiB=torch.cuda.max_memory_allocated() / 2**30, strategy_type=type(trainer.strategy).__name__,
                device=torch.cuda.get_device_name(), torch=torch.__version__)


def llama(steps: int, tiny: bool) -> list[dict]:
    """Each configuration in a process of its own (compile caches and peak memory start clean)."""
    results = []
    for compiled in (False, True):
        for strategy in ("single", "fourd"):
            command = [sys.executable, __file__, "llama-run", strategy, str(int(compiled)), str(steps)] + (
                ["--tiny"] if tiny else [])
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                results.append(dict(kind="llama", strategy=strategy, compile=compiled, failed=done.returncode,
                                    error=(done.stderr or done.stdout)[-3000:]))
            else:
                results.append(json.loads(lines[-1][len("RESULT "):]))
            print("RESULT", json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "llama-run":
        print("RESULT", json.dumps(llama_run(sys.argv[2], bool(int(sys.argv[3])), int(sys.argv[4]),
                                             "--tiny" in sys.argv)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["sync", "llama", "collectives"])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_step.py: needs CUDA (torch.cuda.set_sync_debug_mode and CUDA timing); none here.")
        sys.exit(2)
    results = (sync(args.accelerator) if args.what == "sync" else collectives() if args.what == "collectives"
               else llama(args.steps, args.tiny))
    for result in results:
        print("RESULT", json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
