"""Checkpoint integrity: every file is checksummed when written and verified before loading; a damaged file
is refused by name, with the tensors it holds, on every rank, before any state changes."""

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lightning_4d import checkpoint
from tests.models import Classifier
from tests.parity import ROOT, child_env, free_port, spawn


def _saved(directory, seed=0):
    torch.manual_seed(seed)
    module = Classifier()
    optimizer = module.configure_optimizers()["optimizer"]
    module.net(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    state = {"state_dict": checkpoint.model_state(module),
             "optimizer_states": [checkpoint.optimizer_state(module, optimizer)], "global_step": 1}
    checkpoint.save(state, directory, is_writer=True)
    return module


def _shards(directory):
    return sorted(p for p in directory.iterdir() if p.suffix == ".distcp")


def _flip_bits(file, rng, count=5):
    data = bytearray(file.read_bytes())
    for offset in rng.sample(range(len(data)), count):
        data[offset] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(data))


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _cli(directory):
    return subprocess.run([sys.executable, "-m", "lightning_4d.verify_checkpoint", str(directory)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("damage", ["bit flips", "truncation"])
def test_a_damaged_shard_is_refused_naming_the_file_and_its_tensors(tmp_path, damage):
    directory = tmp_path / "step=1.ckpt"
    _saved(directory)
    assert (directory / checkpoint.CHECKSUM_FILE).is_file()
    files = _shards(directory)
    assert files, list(directory.iterdir())
    rng = random.Random(16)
    for shard in files:
        pristine = shard.read_bytes()
        if damage == "bit flips":
            _flip_bits(shard, rng)
        else:
            shard.write_bytes(pristine[: rng.randrange(len(pristine))])
        target = Classifier(hidden=32)
        optimizer = target.configure_optimizers()["optimizer"]
        before = _state(target)
        with pytest.raises(checkpoint.CorruptCheckpointError) as caught:
            checkpoint.load(directory, target, [optimizer])
        message = str(caught.value)
        assert shard.name in message and "refusing to load" in message, message
        assert "state_dict.net.0.weight" in message, message  # the tensors in the damaged file are named
        assert ("checksum mismatch" if damage == "bit flips" else "truncated") in message, message
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # nothing changed
        assert not optimizer.state
        with pytest.raises(checkpoint.CorruptCheckpointError, match=shard.name):
            checkpoint.load_weights(directory, target)
        done = _cli(directory)
        assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and shard.name in done.stderr, done.stderr
        shard.write_bytes(pristine)
    done = _cli(directory)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


def test_an_intact_checkpoint_loads_and_damaged_metadata_is_refused(tmp_path):
    directory = tmp_path / "ok.ckpt"
    source = _saved(directory, seed=3)
    target = Classifier()
    assert checkpoint.load(directory, target, [])["global_step"] == 1
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    _flip_bits(directory / checkpoint.META_FILE, random.Random(1))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"meta\.pt: checksum mismatch"):
        checkpoint.load(directory, Classifier(), [])
    assert "meta.pt" in _cli(directory).stderr
    assert _cli(tmp_path).returncode == 2  # not a checkpoint directory at all


def _load_on_two_ranks(rank, world_size, out_dir, directory, port):
    import json

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        target = Classifier()
        before = _state(target)
        try:
            checkpoint.load(directory, target, [])
            outcome = "loaded"
        except checkpoint.CorruptCheckpointError as error:
            outcome = str(error)
        unchanged = all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"outcome": outcome, "unchanged": unchanged}, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_refuses_although_only_one_checked_the_damaged_file(tmp_path):
    directory = tmp_path / "two.ckpt"
    _saved(directory)
    shard = _shards(directory)[0]
    _flip_bits(shard, random.Random(5))
    results = spawn(_load_on_two_ranks, 2, 120, str(directory), free_port())
    for rank, result in enumerate(results):
        assert shard.name in result["outcome"] and "refusing to load" in result["outcome"], (rank, result)
        assert result["unchanged"], rank
    assert results[0]["outcome"] == results[1]["outcome"]
