"""Starting from pretrained weights in the forms people have them, and exporting back to Hugging Face.

A Hugging Face Llama from a tiny config, saved with ``save_pretrained`` from a whole model of another seed (one
``model.safetensors``, and sharded into ``model-0000i-of-00004.safetensors`` with its index), is loaded by
``FourDStrategy(init_from=...)`` under tp=2, dp_shard=2, pp=2, cp=2 (one 2-process launch) and tp2 x dp_shard2
(4 processes) and trains as one process that loads the same directory with transformers' ``from_pretrained``
(losses and weights within 1e-5). The same weights as a plain state_dict file (memory-mapped) and as a torch DCP
directory, and torchtitan's Llama (state-dict hooks rename its fused ``wqkv``) from a safetensors directory, load
too. Bad input (a missing or truncated shard, keys the model lacks, keys the files lack, wrong shapes) is refused
by every rank with the same message naming the files, keys and shapes, before any weight changes. The round
trip: HF directory -> init_from -> train -> checkpoint -> ``export --format hf`` -> ``from_pretrained`` gives
the trained model's logits.
"""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_4d import checkpoint
from lightning_4d.checkpoint import PretrainedWeightsError
from tests.lm_models import HFCausalLM, pretrained_llama, token_data
from tests.parity import (ROOT, Case, assert_error, assert_parity, reference, report_difference, train_layout,
                          train_layout_with_failures)

OTHER_SEED = 4321
TITAN = "torchtitan_llama3"
LAYOUTS_2 = {"tp2": {"tp": 2}, "dp_shard2": {"dp_shard": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}
LLAMA = Case("llama", module="tests.lm_models:HFCausalLM", data="tests.lm_models:token_data",
             module_kwargs={"kind": "llama"}, max_steps=2)


def _make_sources(root: Path) -> dict[str, Path]:
    import lightning.pytorch as pl
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from tests.zoo_models import zoo_lm

    pl.seed_everything(OTHER_SEED, verbose=False)
    whole = HFCausalLM(kind="llama")
    paths = {name: root / name for name in ("single", "sharded", "dcp", "titan_hf")}
    whole.model.save_pretrained(paths["single"])
    whole.model.save_pretrained(paths["sharded"], max_shard_size="50KB")
    paths["state_dict"] = root / "state_dict.pt"
    torch.save(whole.state_dict(), paths["state_dict"])  # the LightningModule's keys: "model.model.layers..."
    dcp.save(whole.model.state_dict(), checkpoint_id=paths["dcp"], no_dist=True)  # the HF model's keys
    titan = zoo_lm(TITAN)
    paths["titan_pt"] = root / "titan.pt"
    torch.save(titan.state_dict(), paths["titan_pt"])
    paths["titan_hf"].mkdir()
    save_file({k: v.contiguous().clone() for k, v in titan.state_dict().items()},
              str(paths["titan_hf"] / "model.safetensors"), metadata={"format": "pt"})
    # Damaged copies of the sharded directory: one shard missing, one truncated.
    index = json.loads((paths["sharded"] / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) == 4, files
    for name, damage in (("missing_file", files[1]), ("truncated", files[2])):
        paths[name] = root / name
        shutil.copytree(paths["sharded"], paths[name])
        target = paths[name] / damage
        if name == "missing_file":
            target.unlink()
        else:
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        paths[f"{name}_which"] = Path(damage)
    return paths


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _make_sources(tmp_path_factory.mktemp("pretrained"))


def _case(name: str, strategy: dict, **fields) -> Case:
    return replace(LLAMA, name=name, strategy=strategy, **fields)


def _meta_case(name: str, strategy: dict) -> Case:
    """The same Llama built on the meta device in configure_model (tests/meta_models.py): no rank ever holds it
    whole; the sharded Hugging Face directory fills what each rank holds."""
    return replace(_case(name, strategy), module="tests.meta_models:meta_llama", module_kwargs={})


def _assert_parity(case: Case, expected: dict, got: dict) -> None:
    report_difference(case, expected, got)  # seen with pytest -s
    assert_parity(case, expected, got)


def _reference(path: Path, **fields) -> dict:
    return reference(replace(LLAMA, module="tests.lm_models:pretrained_llama", module_kwargs={"path": str(path)},
                             **fields))


# The bad inputs, each with what every rank's message must name (files, keys, shapes).
def _bad_cases(sources) -> dict[str, tuple[Case, list[str]]]:
    sharded = sources["sharded"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    layer3 = sorted(k for k in index if k.startswith("model.layers.3."))
    return {
        "missing_file": (_case("bad-missing_file", {"tp": 2, "init_from": str(sources["missing_file"])}),
                         [f"{sources['missing_file_which']} is missing", "the index lists"]),
        "truncated": (_case("bad-truncated", {"tp": 2, "init_from": str(sources["truncated"])}),
                      [f"{sources['truncated_which']} is damaged or truncated", "file not fully covered"]),
        "model_lacks": (_case("bad-model_lacks", {"tp": 2, "init_from": str(sharded)},
                              module_kwargs={"kind": "llama", "layers": 3}),
                        ["unexpected keys: ", repr(layer3[0]), f"in {index[layer3[0]]}"]),
        "file_lacks": (_case("bad-file_lacks", {"tp": 2, "init_from": str(sharded)},
                             module_kwargs={"kind": "llama", "layers": 5}),
                       ["missing keys: ['model.model.layers.4."]),
        "shape": (_case("bad-shape", {"tp": 2, "init_from": str(sources["single"])},
                        module_kwargs={"kind": "llama", "kv_heads": 4}),
                  ["wrong shapes: ", "model.model.layers.0.self_attn.k_proj.weight: checkpoint (16, 32) vs model"
                   " (32, 32) in model.safetensors"]),
    }


@pytest.fixture(scope="module")
def two(sources):
    cases = [_case(f"{src}-{name}", {**layout, "init_from": str(sources[src])})
             for src in ("single", "sharded") for name, layout in LAYOUTS_2.items()]
    cases += [_case("state_dict-tp2", {"tp": 2, "init_from": str(sources["state_dict"])}),
              _case("dcp-dp_shard2", {"dp_shard": 2, "init_from": str(sources["dcp"])}),
              replace(_case("titan_hf-tp2", {"tp": 2, "init_from": str(sources["titan_hf"])}),
                      module="tests.zoo_models:zoo_lm", module_kwargs={"family": TITAN})]
    cases += [_meta_case(f"meta-sharded-{name}", {**layout, "init_from": str(sources["sharded"])})
              for name, layout in LAYOUTS_2.items()]
    failing = [case for case, _ in _bad_cases(sources).values()]
    records, errors = train_layout_with_failures(cases, failing, 2, timeout=600)
    return records, errors


@pytest.fixture(scope="module")
def four(sources, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("four")
    layout = {"tp": 2, "dp_shard": 2}
    cases = [_case("single-tp2_dp_shard2", {**layout, "init_from": str(sources["single"])}),
             _case("sharded-tp2_dp_shard2", {**layout, "init_from": str(sources["sharded"])}, max_steps=4,
                   save_last=True),
             replace(_meta_case("meta-sharded-tp2_dp_shard2", {**layout, "init_from": str(sources["sharded"])}),
                     save_last=True)]
    return workdir, train_layout(cases, 4, timeout=420, workdir=str(workdir))


@pytest.mark.parametrize("src", ["single", "sharded"])
@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_hugging_face_directory_trains_as_one_process_that_loads_it(two, sources, src, layout):
    name = f"{src}-{layout}"
    _assert_parity(_case(name, {}), _reference(sources[src]), two[0][name])


@pytest.mark.parametrize("layout", [*LAYOUTS_2, "tp2_dp_shard2"])
def test_meta_built_model_from_a_hugging_face_directory(two, four, sources, layout):
    records = four[1] if layout == "tp2_dp_shard2" else two[0]
    name = f"meta-sharded-{layout}"
    _assert_parity(_case(name, {}), _reference(sources["sharded"]), records[name])


@pytest.mark.parametrize("name", ["state_dict-tp2", "dcp-dp_shard2"])
def test_state_dict_file_and_torch_dcp_directory_load_the_same(two, sources, name):
    _assert_parity(_case(name, {}), _reference(sources["single"]), two[0][name])


def test_torchtitans_renamed_keys_load_from_safetensors(two, sources):
    case = replace(LLAMA, name="titan_hf-tp2", module="tests.zoo_models:zoo_lm_from",
                   module_kwargs={"family": TITAN, "weights": str(sources["titan_pt"])})
    _assert_parity(case, reference(case), two[0]["titan_hf-tp2"])


@pytest.mark.parametrize("src", ["single", "sharded"])
def test_tp2_dp_shard2_from_a_hugging_face_directory(four, sources, src):
    _, records = four
    steps = 4 if src == "sharded" else 2
    _assert_parity(_case(f"{src}-tp2_dp_shard2", {}), _reference(sources[src], max_steps=steps),
                   records[f"{src}-tp2_dp_shard2"])


@pytest.mark.parametrize("bad", ["missing_file", "truncated", "model_lacks", "file_lacks", "shape"])
def test_bad_input_is_refused_on_every_rank(two, sources, bad):
    case, phrases = _bad_cases(sources)[bad]
    outcomes = two[1][case.name]
    assert len(outcomes) == 2, outcomes
    assert_error(outcomes, "PretrainedWeightsError", ["does not fit the model, nothing was loaded", *phrases])


@pytest.mark.parametrize("bad", ["missing_file", "truncated", "model_lacks", "file_lacks", "shape"])
def test_bad_input_changes_no_weight(sources, bad):
    case, phrases = _bad_cases(sources)[bad]
    module = HFCausalLM(**case.module_kwargs)
    before = {key: value.clone() for key, value in module.state_dict().items()}
    with pytest.raises(PretrainedWeightsError) as raised:
        checkpoint.load_weights(case.strategy["init_from"], module)
    for phrase in phrases:
        assert phrase in str(raised.value), (phrase, str(raised.value))
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("src", ["single", "sharded", "state_dict", "dcp"])
def test_one_process_loads_what_from_pretrained_loads(sources, src):
    expected = pretrained_llama(str(sources["single"])).state_dict()
    module = HFCausalLM(kind="llama")
    checkpoint.load_weights(sources[src], module)
    for key, value in module.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_the_prefix_can_be_named(sources):
    module = HFCausalLM(kind="llama")
    checkpoint.load_weights(sources["single"], module, prefix="model")
    with pytest.raises(PretrainedWeightsError, match="none of the file's keys .* with the prefix 'model.model.'"):
        checkpoint.load_weights(sources["single"], module, prefix="model.model.")


def test_round_trip_through_export_gives_the_trained_logits(four, tmp_path):
    """HF directory -> init_from -> train (tp2 x dp_shard2) -> checkpoint -> export --format hf -> from_pretrained."""
    workdir, records = four
    trained = HFCausalLM(kind="llama")
    trained.load_state_dict(records["sharded-tp2_dp_shard2"]["weights"])
    last = workdir / "sharded-tp2_dp_shard2" / "last.ckpt"
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "lightning_4d.export", str(last), str(out), "--format", "hf",
                           "--module", "tests.lm_models:HFCausalLM", "--max-shard-size", "50KB"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files, files
    assert sum(name.endswith(".safetensors") for name in files) > 1, files
    from transformers import LlamaForCausalLM

    tokens = token_data(train=False).tensors[0]
    exported = LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        difference = (exported(input_ids=tokens).logits - trained(tokens)).abs().max().item()
    print(f"round trip: max |logit diff| {difference:.2e}")
    assert difference <= 1e-5, difference
    # and the exported directory starts a model as init_from: the same weights again
    again = HFCausalLM(kind="llama")
    checkpoint.load_weights(out, again)
    for key, value in again.state_dict().items():
        assert torch.equal(value, trained.state_dict()[key]), key


def test_export_builds_a_module_whose_model_comes_from_configure_model(four, tmp_path):
    """``MetaLlama`` builds its Hugging Face model in configure_model (under trainer.init_module): the command
    line runs that hook on the meta device to find the model, its config and its key names."""
    workdir, records = four
    last = workdir / "meta-sharded-tp2_dp_shard2" / "last.ckpt"
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "lightning_4d.export", str(last), str(out), "--format", "hf",
                           "--module", "tests.meta_models:MetaLlama"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(out)
    weights = records["meta-sharded-tp2_dp_shard2"]["weights"]
    for key, value in exported.state_dict().items():
        assert torch.equal(value, weights[f"model.{key}"]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_slices_read_without_memory_maps_are_the_tensors_slices(tmp_path, monkeypatch, dtype):
    """Every block size (one row, a few rows, all rows at once), every slice on every dimension, a scalar; and
    the reader reports a truncated file instead of reading short."""
    from safetensors.torch import save_file

    from lightning_4d.checkpoint import safetensors_slices

    generator = torch.Generator().manual_seed(0)
    tensors = {"cube": (torch.randn(7, 5, 3, generator=generator) * 100).to(dtype),
               "scalar": torch.tensor(3.5).to(dtype)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    stored = safetensors_slices.read_header(tmp_path / "model.safetensors")
    for block_bytes in (1, 2 * 15 * dtype.itemsize, 1 << 20):
        monkeypatch.setattr(safetensors_slices, "BLOCK_BYTES", block_bytes)
        for offsets, lengths in [((0, 0, 0), (7, 5, 3)), ((3, 0, 0), (4, 5, 3)), ((0, 2, 0), (7, 3, 3)),
                                 ((1, 1, 2), (5, 3, 1)), ((6, 4, 2), (1, 1, 1))]:
            out = torch.full(lengths, -1).to(dtype)
            safetensors_slices.read_slice(stored["cube"], offsets, lengths, out)
            expected = tensors["cube"][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
            assert torch.equal(out, expected), (block_bytes, offsets, lengths)
    out = torch.zeros(()).to(dtype)
    safetensors_slices.read_slice(stored["scalar"], (), (), out)
    assert torch.equal(out, tensors["scalar"])
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:stored["cube"].begin + 8])
    with pytest.raises(OSError, match="truncated"):
        safetensors_slices.read_slice(stored["cube"], (0, 0, 0), (7, 5, 3), torch.empty(7, 5, 3).to(dtype))


def test_a_state_dict_files_pages_leave_the_resident_set_once_copied(tmp_path):
    """Loading from a memory-mapped state_dict file: after the copy, the file's mapping holds (almost) no resident
    pages, although the mapping itself is still open; the weights are the file's. Linux: /proc/self/smaps."""
    from lightning_4d.checkpoint.pretrained import _copy_own_parts

    weights = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MB
    torch.save(weights, tmp_path / "weights.pt")
    mapped = torch.load(tmp_path / "weights.pt", weights_only=True, mmap=True)
    targets = {key: torch.empty(256, 1024) for key in weights}
    _copy_own_parts(mapped, {key: key for key in weights}, targets, mapped=True)
    assert all(torch.equal(targets[key], weights[key]) for key in weights)
    assert _resident_kb(tmp_path / "weights.pt") <= 8, _resident_kb(tmp_path / "weights.pt")
    assert all(torch.equal(mapped[key], weights[key]) for key in weights)  # read back from the page cache
    assert _resident_kb(tmp_path / "weights.pt") >= 4000  # what reading the file keeps without the release


def _resident_kb(path) -> int:
    """Resident kB of this process's mappings of ``path``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total
