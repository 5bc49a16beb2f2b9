"""A checkpoint saved in one layout resumes in another, optimizer state included, as one process would go on.

Layout pairs (dp x pp x cp x tp): one process -> 2x2x1x2, 2x2x1x2 -> 1x1x2x2 (also from a checkpoint written
asynchronously), 2x2x1x2 -> one process; and with
sharded data parallelism: one process -> dp_shard=4 -> 2x1x1x2 -> dp_shard=4, dp_shard=4 -> one process. The model
is the Hugging Face Llama from a tiny config (grouped K/V heads, sharded by kv-head under tensor parallelism),
trained with SGD, momentum 0.9: a resume that lost or misplaced a momentum buffer would move its weights by a
step's worth, far outside the 1e-5 bound. Every resumed run is compared with the uninterrupted single-process
run after the checkpointed step: losses and logged train_loss per step within 1e-5 relative, final weights
within 1e-5 + 1e-5*|w|.
"""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_4d import checkpoint
from lightning_4d.checkpoint import export_checkpoint
from tests.lm_models import HFCausalLM, token_data, torch_file_of
from tests.parity import ROOT, Case, after_step, assert_exact_resume, assert_parity, reference, train, train_layout

SAVE = 2
LLAMA = Case("llama", module="tests.lm_models:HFCausalLM", data="tests.lm_models:token_data",
             module_kwargs={"kind": "llama"}, batch_size=8, max_steps=4)
A = {"dp": 2, "pp": 2, "cp": 1, "tp": 2}
B = {"dp": 1, "pp": 1, "cp": 2, "tp": 2}
C = {"dp_shard": 4}  # FSDP2: parameters, gradients and momentum sharded over 4 ranks
D = {"dp": 2, "tp": 2}


def _case(name: str, **fields) -> Case:
    return replace(LLAMA, name=name, **fields)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reshard")

    def ckpt(name: str) -> str:
        return str(workdir / name / f"epoch=0-step={SAVE}.ckpt")

    # One process (FourDStrategy on one device), here: saves at step 2 and resumes from it in a new Trainer.
    records = {"one": train(_case("one", resume_at=SAVE), distributed=True, workdir=str(workdir))}

    eight = [_case("A", strategy=A, resume_at=SAVE), _case("one_to_A", strategy=A, resume_from=ckpt("one")),
             _case("A_async", strategy=dict(A, async_save=True), resume_at=SAVE)]  # written in the background
    records.update(train_layout(eight, 8, timeout=420, workdir=str(workdir)))

    # The 2x2x1x2 checkpoint as one plain file (our export) starts training, without optimizer state, in 1x1x2x2;
    # so does the asynchronously written one (init_from its directory). Both must train as one plain process that
    # loads the weights without lightning-4d (below).
    plain = export_checkpoint(ckpt("A"), workdir / "A.ckpt")
    from_plain = dict(max_steps=SAVE)
    four = [_case("A_to_B", strategy=B, resume_from=ckpt("A")), _case("A_async_to_B", strategy=B, resume_from=ckpt("A_async")),
            _case("plain_to_B", strategy=dict(B, init_from=str(plain)), **from_plain),
            _case("async_init_B", strategy=dict(B, init_from=ckpt("A_async")), **from_plain),
            # Sharded data parallelism and back: dp_shard=4 <-> 2 replicas x tp=2 <-> one process.
            _case("C", strategy=C, resume_at=SAVE), _case("one_to_C", strategy=C, resume_from=ckpt("one")),
            _case("C_to_D", strategy=D, resume_from=ckpt("C")),
            _case("D", strategy=D, resume_at=SAVE), _case("D_to_C", strategy=C, resume_from=ckpt("D"))]
    records.update(train_layout(four, 4, timeout=300, workdir=str(workdir)))
    records["A_to_one"] = train(_case("A_to_one", resume_from=ckpt("A")), distributed=True)
    records["C_to_one"] = train(_case("C_to_one", resume_from=ckpt("C")), distributed=True)
    # One plain process (Lightning's own strategy) that loads the 2x2x1x2 checkpoint's weights as torch converts
    # the directory and as a user loads a file: nothing of lightning-4d on this side.
    torch_file = torch_file_of(ckpt("A"), str(workdir / "A_by_torch.pt"))
    records["plain_to_one"] = train(_case("plain_to_one", module="tests.lm_models:loaded_module",
                                          module_kwargs={"build": LLAMA.module, "path": torch_file,
                                                         **LLAMA.module_kwargs}, **from_plain), distributed=False)
    return ckpt, records


@pytest.mark.parametrize("name", ["one_to_A", "A_to_B", "A_async_to_B", "A_to_one", "one_to_C", "C_to_D", "D_to_C",
                                  "C_to_one"])
def test_a_checkpoint_resumes_in_another_layout_as_one_process_goes_on(runs, name):
    _, records = runs
    assert_parity(_case(name), after_step(reference(LLAMA), SAVE), records[name])


@pytest.mark.parametrize("name", ["one", "A", "A_async", "C", "D"])
def test_resume_in_the_same_layout_is_exact(runs, name):
    _, records = runs
    assert_exact_resume(records[name])
    assert_parity(_case(name), reference(LLAMA), records[name])


def test_optimizer_state_of_a_sharded_checkpoint_loads_into_one_process(runs):
    """The 2x2x1x2 checkpoint (TP shards, two pipeline stages) and the one-process checkpoint, both at step 2,
    load into one plain process with the same weights and momentum buffers."""
    ckpt, _ = runs
    loaded = {}
    for name in ("A", "one"):
        module = HFCausalLM(kind="llama")
        optimizer = module.configure_optimizers()
        assert checkpoint.load(ckpt(name), module, [optimizer])["global_step"] == SAVE
        loaded[name] = module, {n: optimizer.state[p]["momentum_buffer"] for n, p in module.named_parameters()}
    (sharded, sharded_momentum), (single, single_momentum) = loaded["A"], loaded["one"]
    torch.testing.assert_close(sharded.state_dict(), single.state_dict(), rtol=1e-5, atol=1e-5)
    assert set(sharded_momentum) == {name for name, _ in single.named_parameters()}
    torch.testing.assert_close(sharded_momentum, single_momentum, rtol=1e-5, atol=1e-5)
    assert all(buffer.abs().sum() > 0 for buffer in single_momentum.values())


def test_plain_weights_start_training_in_a_layout_as_in_one_process(runs):
    _, records = runs
    assert_parity(_case("plain_to_B"), records["plain_to_one"], records["plain_to_B"])
    # init_from the checkpoint written in the background: the same weights, the same training
    assert_parity(_case("async_init_B"), records["plain_to_one"], records["async_init_B"])


def test_a_4d_checkpoint_exports_to_a_plain_file_and_a_hugging_face_directory(runs, tmp_path):
    ckpt, _ = runs
    trained = HFCausalLM(kind="llama")  # the weights as torch's own converter reads the directory
    by_torch = torch_file_of(ckpt("A"), str(tmp_path / "A.pt"))
    trained.load_state_dict(torch.load(by_torch, weights_only=True)["state_dict"])
    tokens = token_data(train=False).tensors[0]

    module = HFCausalLM(kind="llama")
    exported = torch.load(export_checkpoint(ckpt("A"), tmp_path / "m.ckpt"), weights_only=True)
    module.load_state_dict(exported["state_dict"])
    assert torch.equal(module(tokens), trained(tokens))

    done = subprocess.run([sys.executable, "-m", "lightning_4d.export", ckpt("A"), str(tmp_path / "hf"), "--hf",
                           "--module", "tests.lm_models:HFCausalLM"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(hf(input_ids=tokens).logits, trained(tokens))


def test_an_async_checkpoint_exports_and_loads_as_the_synchronous_one(runs, tmp_path):
    """The 2x2x1x2 checkpoint written in the background holds what the synchronous one holds: exported to one
    file, the same tensors bit for bit; loaded into one process, the same momentum buffers."""
    ckpt, _ = runs
    files = [torch.load(export_checkpoint(ckpt(name), tmp_path / f"{name}.ckpt"), weights_only=True)
             for name in ("A", "A_async")]
    assert files[0]["state_dict"].keys() == files[1]["state_dict"].keys()
    for key, value in files[0]["state_dict"].items():
        assert torch.equal(value, files[1]["state_dict"][key]), key
    momentum = []
    for name in ("A", "A_async"):
        module = HFCausalLM(kind="llama")
        optimizer = module.configure_optimizers()
        checkpoint.load(ckpt(name), module, [optimizer])
        momentum.append({n: optimizer.state[p]["momentum_buffer"] for n, p in module.named_parameters()})
    assert momentum[0].keys() == momentum[1].keys()
    assert all(torch.equal(value, momentum[1][key]) for key, value in momentum[0].items())


def test_no_rank_writes_the_whole_model(runs):
    """2x2x1x2: each rank holds a quarter of the weights (two tp shards of one of two stages) and writes at
    most that; a replicated tensor (dp peers, norms shared by tp peers) is written by one rank only."""
    ckpt, _ = runs
    files = sorted(Path(ckpt("A")).glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    single = sum(f.stat().st_size for f in Path(ckpt("one")).glob("*.distcp"))  # weights + momentum, whole
    assert len(files) >= 4, files
    assert max(sizes) < 0.4 * single, (sizes, single)
    assert sum(sizes) < 1.2 * single, (sizes, single)  # replicas are not written once per replica
