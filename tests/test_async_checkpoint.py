"""Asynchronous checkpoint saves (``FourDStrategy(async_save=True)``, Lightning's ``AsyncCheckpointIO``) and
``last`` written once (:mod:`lightning_4d.checkpoint.writer`).

In one process, on the writer itself: a save in flight is invisible (no directory under its name, removals and
links held back) until its write is complete; the next save waits for it and says so once; staging reuses its host
buffers; a failed background write fails the next step; a save of unchanged tensors hard-links the previous one's
files and an in-place change makes it write them again. In one 2-process launch, dp_shard=2, tp=2 and pp=2 each
save at step 2 with ``save_last=True``, synchronously and asynchronously (pp=2 through the ``AsyncCheckpointIO``
plugin): every resumed run equals its uninterrupted run bit for bit and one process within 1e-5, and the async
checkpoints hold the same tensors and loop state as the synchronous ones. (2x2x2 and loading an async checkpoint
in another layout and by export: tests/test_resharding.py; a rank killed during a background write:
tests/test_checkpoint.py.)
"""

import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_4d import FourDStrategy, checkpoint
from lightning_4d.checkpoint import integrity, sharded
from lightning_4d.checkpoint.export import read_checkpoint
from lightning_4d.checkpoint.writer import CheckpointWriter
from tests.parity import Case, assert_exact_resume, assert_parity, reference, train_layout


def _state(scale: float = 1.0) -> dict:
    torch.manual_seed(0)
    return {"state_dict": {"w": torch.randn(64, 32) * scale, "b": torch.randn(32)},
            "optimizer_states": [{"state.w.exp_avg": torch.zeros(64, 32), "param_groups.w.lr": 0.1}],
            "global_step": 3}


def _writer(**options) -> CheckpointWriter:
    return CheckpointWriter(asynchronous=True, is_writer=True, agree=lambda decision: decision, **options)


@pytest.fixture
def slow_write(monkeypatch):
    """Background writes wait until the test releases them."""
    release = threading.Event()
    write = sharded.write

    def held(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # a synchronous save is not held
            assert release.wait(60), "the test never released the write"
        return write(*args, **kwargs)

    monkeypatch.setattr(sharded, "write", held)
    return release


def test_a_save_in_flight_stays_invisible_with_its_removals_and_links_until_complete(tmp_path, slow_write):
    writer, state = _writer(), _state()
    old, new, link = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt", tmp_path / "last.ckpt"
    sharded.save(_state(2.0), old, is_writer=True)
    writer.save(state, str(new))
    writer.link(str(new), str(link))
    writer.remove(str(old))
    assert not new.exists() and old.exists() and not link.exists()  # nothing seen before the write is complete
    slow_write.set()
    writer.finish()
    assert not old.exists() and link.is_symlink() and link.resolve() == new.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"]  # no .partial left
    loaded = read_checkpoint(link)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["global_step"] == 3
    assert integrity.verify(new) == []


def test_the_next_save_waits_for_the_one_in_flight_and_says_so_once(tmp_path, slow_write, capfd):
    writer = _writer()
    writer.save(_state(), str(tmp_path / "a.ckpt"))
    threading.Timer(0.3, slow_write.set).start()
    writer.save(_state(3.0), str(tmp_path / "b.ckpt"))  # waits for a's write
    assert (tmp_path / "a.ckpt").is_dir()
    writer.save(_state(4.0), str(tmp_path / "c.ckpt"))
    writer.finish()
    said = capfd.readouterr().err
    assert said.count("at most one save is in flight") == 1, said
    assert writer.blocked_seconds[1] >= 0.2  # the second save waited; none else had to
    assert all((tmp_path / name).is_dir() for name in ("a.ckpt", "b.ckpt", "c.ckpt"))


def test_staging_reuses_its_host_buffers_and_copies_the_values_of_the_moment(tmp_path):
    writer, state = _writer(), _state()
    buffers = []
    for step in range(4):
        state["state_dict"]["w"].add_(1.0)  # the values at each save, not those of later steps
        writer.save(state, str(tmp_path / f"step={step}.ckpt"))
        buffers.append(writer.staging.buffers["state_dict"]["w"].data_ptr())
        state["state_dict"]["w"].add_(100.0)  # training goes on while the write runs
        writer.wait()
    assert writer.staging.allocations == 1 and len(set(buffers)) == 1
    first = read_checkpoint(tmp_path / "step=0.ckpt")["state_dict"]["w"]
    torch.testing.assert_close(first, _state()["state_dict"]["w"] + 1.0, rtol=0, atol=0)
    state["state_dict"]["w"] = torch.zeros(8)  # another shape: new buffers
    writer.save(state, str(tmp_path / "other.ckpt"))
    writer.finish()
    assert writer.staging.allocations == 2


def test_a_failed_background_write_fails_the_next_step_naming_the_checkpoint(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(sharded, "write", broken)
    writer = _writer()
    writer.save(_state(), str(tmp_path / "step=2.ckpt"))
    writer._flight.thread.join()
    with pytest.raises(RuntimeError, match=r"step=2.ckpt in the background failed on rank 0: OSError\('No space"):
        writer.raise_if_failed()
    assert not (tmp_path / "step=2.ckpt").exists()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_of_unchanged_tensors_links_the_files_and_a_change_writes_them(tmp_path, asynchronous):
    writer = CheckpointWriter(asynchronous, is_writer=True, agree=lambda decision: decision)
    state = _state()
    writer.save(state, str(tmp_path / "step=2.ckpt"))
    writer.save(dict(state, global_step=4), str(tmp_path / "last.ckpt"))  # ModelCheckpoint's save_last
    writer.wait()
    shard = "__0_0.distcp"
    assert os.path.samefile(tmp_path / "step=2.ckpt" / shard, tmp_path / "last.ckpt" / shard)
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4
    assert integrity.verify(tmp_path / "last.ckpt") == []
    writer.remove(str(tmp_path / "step=2.ckpt"))
    writer.wait()
    assert torch.equal(read_checkpoint(tmp_path / "last.ckpt")["state_dict"]["w"], state["state_dict"]["w"])
    state["state_dict"]["w"].mul_(2)  # an optimizer step: written again, not linked
    writer.save(state, str(tmp_path / "step=3.ckpt"))
    writer.save(dict(state, optimizer_states=[{"state.w.exp_avg": state["optimizer_states"][0]["state.w.exp_avg"],
                                               "param_groups.w.lr": 0.05}]), str(tmp_path / "step=3b.ckpt"))
    writer.finish()  # a learning rate that changed is a change too
    assert not os.path.samefile(tmp_path / "last.ckpt" / shard, tmp_path / "step=3.ckpt" / shard)
    assert not os.path.samefile(tmp_path / "step=3.ckpt" / shard, tmp_path / "step=3b.ckpt" / shard)
    assert torch.equal(read_checkpoint(tmp_path / "step=3.ckpt")["state_dict"]["w"], state["state_dict"]["w"])


class _OtherIO(pl.plugins.TorchCheckpointIO):
    pass


def test_a_checkpoint_io_plugin_is_honored_or_refused_at_construction():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(), plugins=[AsyncCheckpointIO()],
                         logger=False)
    assert trainer.strategy.async_save is True
    with pytest.raises(ValueError, match=r"cannot save through _OtherIO\. Remove the plugin; .*async_save=True"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(), plugins=[_OtherIO()], logger=False)


SAVE = 2
BASE = Case("gpt", module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data", max_steps=4,
            resume_at=SAVE, save_last=True)
LAYOUTS = {"dp_shard2": {"dp_shard": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
PLUGIN = {"plugins": ["lightning.pytorch.plugins.io:AsyncCheckpointIO"]}


def _cases() -> list[Case]:
    cases = []
    for name, layout in LAYOUTS.items():
        cases.append(replace(BASE, name=f"{name}_sync", strategy=layout))
        asynchronous = (dict(strategy=layout, trainer=PLUGIN) if name == "pp2"
                        else dict(strategy=dict(layout, async_save=True)))
        cases.append(replace(BASE, name=f"{name}_async", **asynchronous))
    return cases


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("async")
    return workdir, train_layout(_cases(), 2, timeout=400, workdir=str(workdir))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_async_saves_hold_what_sync_saves_hold_and_resume_exactly(saved, layout):
    workdir, records = saved
    for mode in ("sync", "async"):
        record = records[f"{layout}_{mode}"]
        assert_exact_resume(record)
        assert_parity(BASE, reference(BASE), record)
    for name in (f"epoch=0-step={SAVE}.ckpt", "last.ckpt"):
        sync, asynchronous = (read_checkpoint(workdir / f"{layout}_{mode}" / name) for mode in ("sync", "async"))
        assert sync["state_dict"].keys() == asynchronous["state_dict"].keys()
        for key, value in sync["state_dict"].items():
            assert torch.equal(value, asynchronous["state_dict"][key]), (layout, name, key)
        assert sync["loops"] == asynchronous["loops"] and sync["global_step"] == asynchronous["global_step"]
    # optimizer state too: every tensor of the two directories, read as DCP reads them
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = []
    for mode in ("sync", "async"):
        dcp_to_torch_save(workdir / f"{layout}_{mode}" / f"epoch=0-step={SAVE}.ckpt", workdir / f"{layout}_{mode}.pt")
        whole.append(torch.load(workdir / f"{layout}_{mode}.pt", weights_only=True))
    flat = [_flat(tree) for tree in whole]
    assert flat[0].keys() == flat[1].keys() and any(".momentum_buffer" in key for key in flat[0]), sorted(flat[0])[:8]
    for key, value in flat[0].items():
        assert torch.equal(value, flat[1][key]) if isinstance(value, torch.Tensor) else value == flat[1][key], key
    # last.ckpt (of the last step, 4) was not written a second time: its shard files are the step's
    async_dir = workdir / f"{layout}_async"
    assert os.path.samefile(async_dir / "last.ckpt" / ".metadata", async_dir / "epoch=0-step=4.ckpt" / ".metadata")
    assert not list(async_dir.glob("*.partial"))


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {key: value for name, item in tree.items() for key, value in _flat(item, f"{prefix}{name}.").items()}
    return {prefix: tree}


def test_a_save_after_fit_is_complete_when_the_process_exits(tmp_path):
    from tests.parity import launch

    codes, output = launch(["-m", "tests.save_after_fit_script", str(tmp_path)], 1, timeout=120)
    assert codes == [0], output[-3000:]
    assert "save_checkpoint returned; complete yet: False" in output, output[-3000:]  # it was written in the background
    assert (tmp_path / "final.ckpt" / checkpoint.META_FILE).is_file()
    assert integrity.verify(tmp_path / "final.ckpt") == []
    assert checkpoint.read_meta(tmp_path / "final.ckpt")["global_step"] == 1


def _fit_with_checkpoints(directory, async_save, save_last, max_steps, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from tests.models import Classifier, classification_data

    pl.seed_everything(3, verbose=False)
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                            save_last=save_last)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(async_save=async_save),
                         max_steps=max_steps, callbacks=[saver], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = Classifier()
    trainer.fit(module, DataLoader(classification_data(), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return {key: value.clone() for key, value in module.state_dict().items()}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_model_checkpoint_top_k_and_last_leave_the_same_checkpoints_async_as_sync(tmp_path, save_last):
    """Top-2 by step, every 2 steps, 7 steps, with ``last``: the same directories, ``last`` the newest (a link with
    "link", the newest's files with True), and resuming from "last" gives the same weights either way."""
    listings, weights = {}, {}
    for async_save in (False, True):
        directory = tmp_path / ("async" if async_save else "sync")
        _fit_with_checkpoints(directory, async_save, save_last, max_steps=7)
        listings[async_save] = sorted(p.name for p in directory.iterdir())
        last = directory / "last.ckpt"
        assert last.is_symlink() == (save_last == "link")
        newest = directory / "epoch=0-step=6.ckpt"
        assert (last.resolve() == newest.resolve()) if save_last == "link" else \
            os.path.samefile(last / ".metadata", newest / ".metadata")
        weights[async_save] = _fit_with_checkpoints(directory, async_save, save_last, max_steps=9, ckpt_path="last")
    assert listings[False] == listings[True] == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert all(torch.equal(value, weights[True][key]) for key, value in weights[False].items())


def test_a_checkpoint_replaced_in_place_is_never_missing(tmp_path, monkeypatch):
    """``last.ckpt`` over ``last.ckpt``: on Linux the two directories swap names in one step (``renameat2``); where
    the system cannot swap, the old one steps aside and is gone once the new one is in place. Either way nothing
    is left behind and the new checkpoint is whole."""
    exchange, swaps = sharded._exchange, []  # noqa: SLF001
    monkeypatch.setattr(sharded, "_exchange", lambda first, second: swaps.append(exchange(first, second)) or swaps[-1])
    for swapped in (True, False):
        if not swapped:
            monkeypatch.setattr(sharded, "_exchange", lambda first, second: False)
        last = tmp_path / f"last-{swapped}.ckpt"
        for step in (2, 4):
            sharded.save(dict(_state(float(step)), global_step=step), last, is_writer=True)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(last.name)) == [last.name]
        assert checkpoint.read_meta(last)["global_step"] == 4 and integrity.verify(last) == []
        assert torch.equal(read_checkpoint(last)["state_dict"]["w"], _state(4.0)["state_dict"]["w"])
    assert swaps == [True]  # the second save of the first name was one atomic swap


_HOLD_A_WRITER = """
import sys, time
from lightning_4d.checkpoint.writer_process import SharedBlock, WriterProcess
process = WriterProcess()
process.share(SharedBlock(1024))  # answered: the process serves
print(process.process.pid, flush=True)
time.sleep(120)
"""


def test_the_writer_process_dies_with_its_rank_even_in_the_middle_of_a_write(tmp_path):
    """A writer process that cannot notice its rank's end by itself (stopped, as one in the middle of a long write
    reads no message) is killed with it (``PR_SET_PDEATHSIG``), so that a restarted attempt never races a dead
    attempt's writer over the same ``.partial`` directory."""
    import signal

    from tests.test_checkpoint import _ended

    rank = subprocess.Popen([sys.executable, "-c", _HOLD_A_WRITER], stdout=subprocess.PIPE, text=True)
    writer_pid = None
    try:
        writer_pid = int(rank.stdout.readline())
        os.kill(writer_pid, signal.SIGSTOP)
        rank.kill()
        rank.wait(30)
        assert _ended(writer_pid), f"the writer process {writer_pid} outlived its rank"
    finally:
        rank.kill()
        if writer_pid is not None and not _ended(writer_pid, within_s=0):
            os.kill(writer_pid, signal.SIGKILL)
