"""Single-process checks that the example model and data are sound before any parallelism."""

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_4d.demos.data import TextDataModule, read_stdlib_source
from lightning_4d.demos.gpt import GPT
from tests.parity import script_env

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)


def test_stdlib_source_is_deterministic_python_text():
    first = read_stdlib_source(20_000)
    assert len(first) == 20_000
    assert first == read_stdlib_source(20_000)
    assert b"import " in first or b"def " in first


def test_datamodule_yields_shifted_windows():
    dm = TextDataModule(seq_len=16, batch_size=4, max_bytes=20_000, val_fraction=0.1)
    dm.setup("fit")
    raw = read_stdlib_source(20_000)
    inputs, labels = dm.train_set.tensors
    assert bytes(inputs[0].tolist()) == raw[:16]
    assert bytes(labels[0].tolist()) == raw[1:17]
    assert bytes(inputs[1].tolist()) == raw[17:33]  # windows do not overlap
    n = 20_000 // 17
    assert len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == n
    assert len(dm.val_set) == len(dm.test_set) == int(n * 0.1)
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        x, y = next(iter(loader))
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_datamodule_reads_a_named_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 4)
    dm = TextDataModule(path=str(text), seq_len=7, batch_size=2, val_fraction=0.1)
    dm.setup("fit")
    assert bytes(dm.train_set.tensors[0][0].tolist()) == bytes(range(7))


def test_model_is_causal_and_ties_weights():
    torch.manual_seed(0)
    model = GPT(**TINY, tie_weights=True).eval()
    assert model.model.lm_head.weight is model.model.tok_emb.weight
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(idx)[:, :20], model(changed)[:, :20], atol=1e-6)
        assert model.predict_step((idx, idx), 0).shape == (2,)


def test_warmup_scheduler_steps_per_batch():
    config = GPT(**TINY, warmup_steps=4).configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"
    assert config["optimizer"].param_groups[0]["lr"] == pytest.approx(3e-3 / 4)


def test_a_few_steps_reduce_the_loss():
    L.seed_everything(0)
    dm = TextDataModule(seq_len=32, batch_size=8, max_bytes=50_000)
    dm.setup("fit")
    model = GPT(**TINY)
    batch = next(iter(dm.val_dataloader()))
    before = model._loss(batch).item()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=40,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    after = model._loss(batch).item()
    assert before > 5.0  # about ln(256) for an untrained byte model
    assert after < before - 1.0


def test_cli_runs_single_process(tmp_path):
    env = script_env()
    cmd = [
        sys.executable,
        "examples/train.py",
        "fit",
        "--config",
        "examples/configs/single.yaml",
        "--trainer.max_steps",
        "3",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "config.yaml").exists()
