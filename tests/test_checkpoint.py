"""Checkpoints: export to one plain file, start from plain weights, refuse what does not fit, survive a crash
while saving. (Resharding across layouts: tests/test_resharding.py.)"""

import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy, checkpoint
from lightning_4d.checkpoint import export_checkpoint
from tests.models import Classifier, classification_data
from tests.lm_models import tiny_gpt
from tests.parity import ROOT, Case, after_step, assert_parity, reference, run_layout, train, train_layout


@pytest.fixture(scope="module")
def dp2_checkpoint(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ckpt")
    case = Case("dp2", module="tests.models:Classifier", data="tests.models:classification_data",
                strategy={"dp": 2}, max_steps=4, resume_at=4)
    results = train_layout([case], 2, timeout=180, workdir=str(workdir))
    return workdir / "dp2" / "epoch=0-step=4.ckpt", results["dp2"]["extras"]["uninterrupted"]["weights"]


def test_export_gives_the_plain_module_the_trained_weights(dp2_checkpoint, tmp_path):
    directory, trained = dp2_checkpoint
    out = tmp_path / "model.ckpt"
    done = subprocess.run([sys.executable, "-m", "lightning_4d.export", str(directory), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = torch.load(out, weights_only=True)
    assert exported["global_step"] == 4
    module = Classifier()
    module.load_state_dict(exported["state_dict"])  # the unchanged module, strict
    for name, value in module.state_dict().items():
        assert torch.equal(value, trained[name]), name
    reference = Classifier()
    reference.load_state_dict(trained)
    x = classification_data(train=False).tensors[0]
    assert torch.equal(module.net(x), reference.net(x))
    assert type(Classifier.load_from_checkpoint(out, weights_only=True)) is Classifier


def test_init_from_plain_weights_in_a_layout(dp2_checkpoint, tmp_path):
    directory, trained = dp2_checkpoint
    for source in (directory, export_checkpoint(directory, tmp_path / "m.ckpt")):
        torch.save(trained, tmp_path / "plain_state_dict.pt")
        for path in (source, tmp_path / "plain_state_dict.pt"):
            module = Classifier()
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(init_from=str(path)),
                                 logger=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.validate(module, DataLoader(classification_data(train=False), batch_size=8), verbose=False)
            for name, value in module.state_dict().items():
                assert torch.equal(value, trained[name]), (path, name)


def test_checkpoint_that_does_not_fit_is_refused_with_every_key_named(dp2_checkpoint, tmp_path):
    directory, trained = dp2_checkpoint
    wrong = Classifier(hidden=48)  # other shapes
    with pytest.raises(ValueError,
                       match=r"does not fit the model: wrong shapes: \['net.0.weight: checkpoint \(32, 16\) vs model \(48, 16\)'"):
        checkpoint.load_weights(directory, wrong)
    state = dict(trained)
    state.pop("net.4.bias")
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"missing keys: \['net.4.bias'\]; unexpected keys: \['extra.weight'\]"):
        checkpoint.load_weights(tmp_path / "other.pt", Classifier())


def test_loading_never_runs_code_from_the_file(tmp_path):
    class Payload:
        def __reduce__(self):
            return (exec, ("open(%r, 'w').write('pwned')" % str(tmp_path / "pwned"),))

    torch.save({"state_dict": {"net.0.weight": torch.zeros(1)}, "evil": Payload()}, tmp_path / "evil.ckpt")
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoint.load_weights(tmp_path / "evil.ckpt", Classifier())
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_to_resume_from(tmp_path, async_save):
    """tp=2, a checkpoint every 2 steps plus last.ckpt. Rank 1 is killed (SIGKILL) while it writes its shard of
    step 4 (with ``async_save``, in the background writer while training goes on): the step-2 checkpoints stay
    complete and ``last.ckpt`` is still step 2's; the half-written one is a ``.partial`` directory that neither
    ``ckpt_path="last"`` nor a ``*.ckpt`` glob finds, and that cannot be loaded by mistake. Resuming from
    "last" in one process continues as the uninterrupted single-process run (1e-5), and (async) in tp=2 as the
    uninterrupted tp=2 run, bit for bit."""
    case = Case("killed", module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data",
                strategy={"tp": 2, "async_save": async_save}, max_steps=6, resume_at=2, save_last=True,
                callbacks=["tests.probes:DieWhileSaving"])
    result = run_layout([case], 2, timeout=240, workdir=str(tmp_path), grace=60)
    thread = "lightning-4d checkpoint writer" if async_save else "MainThread"
    assert f"step=4.ckpt.partial (thread: {thread})" in result.output, result.output[-4000:]
    assert result.returncodes[1] == -9 and result.returncodes[0] > 0, (result.returncodes, result.output[-4000:])
    if async_save:  # the killed rank's writer process died with it
        writer_pid = int(re.search(r"\(writer process: (\d+)\)", result.output).group(1))
        assert _ended(writer_pid), f"the writer process {writer_pid} outlived its rank"

    folder = tmp_path / "killed"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt.partial",
                                                        "last.ckpt"]
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    half_written = folder / "epoch=0-step=4.ckpt.partial"
    assert (half_written / "__1_0.distcp").stat().st_size == 1000 and not (half_written / checkpoint.META_FILE).exists()
    with pytest.raises(FileNotFoundError, match="interrupted save and cannot be resumed from"):
        checkpoint.load(half_written, tiny_gpt(), [])
    assert checkpoint.read_meta(folder / "last.ckpt")["global_step"] == 2

    resumed = train(replace(case, strategy={}, max_steps=4, resume_at=None, resume_from="last", callbacks=[]),
                    distributed=True, workdir=str(tmp_path))
    assert_parity(case, after_step(reference(replace(case, max_steps=4)), 2), resumed)
    if async_save:  # and in its own layout, bit for bit as if no rank had died
        plain = replace(case, max_steps=4, resume_at=None, callbacks=[])
        runs = train_layout([replace(plain, name="uninterrupted"),
                             replace(plain, name="resumed", resume_from=str(folder / "last.ckpt"))], 2, timeout=240)
        assert runs["resumed"]["losses"] == runs["uninterrupted"]["losses"][2:]
        for name, value in runs["uninterrupted"]["weights"].items():
            assert torch.equal(runs["resumed"]["weights"][name], value), name


def _ended(pid: int, within_s: float = 10.0) -> bool:
    """``pid`` is gone or a zombie (ended, not yet reaped by whoever adopted it) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_load_from_checkpoint_on_a_directory_names_the_export_command(tmp_path):
    # importing lightning_4d (above) wrapped Lightning's loader
    with pytest.raises(IsADirectoryError, match=r"that is a directory.*python -m lightning_4d.export .* model.ckpt"):
        Classifier.load_from_checkpoint(tmp_path)
