"""The step-time model (:mod:`lightning_4d.planner.step_time`), its calibration probe and the planner's ranking by
predicted time: arithmetic checks of each part against hand-computed figures, the planner choosing activation
checkpointing only where memory needs it, the probe measuring 2 gloo processes here and caching the result,
the command line's time column and reason, and its trials through the strategy. (How close predictions come to
measured steps: bench/step_time.py and docs/performance.md; no timing is asserted here.)"""

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from lightning_4d.data_parallel import DEFAULT_BUCKET_MB
from lightning_4d.planner import Layout, Model, PlanError, Training, plan
from lightning_4d.planner import calibration
from lightning_4d.planner.cli import main
from lightning_4d.planner.step_time import BUCKET_MB, Link, Machine, step_time
from tests.parity import script_env

GPT = Model.from_sizes(layers=4, hidden=256, heads=4, vocab=512)
TRAINING = Training(seq_len=256, global_batch=8)


def _machine(**changes) -> Machine:
    figures = dict(matmul_flops={"float32": 1e10}, memory_bandwidth=1e10, links={2: Link(1e-4, 1e9), 4: Link(2e-4, 1e9)},
                   devices_per_node=4)
    return Machine(**{**figures, **changes})


def test_the_bucket_size_is_the_data_parallel_default():
    assert BUCKET_MB == DEFAULT_BUCKET_MB


def test_compute_is_six_flops_per_parameter_and_token_plus_attention_over_the_throughput():
    one = step_time(GPT, TRAINING, Layout(), _machine())
    tokens = TRAINING.seq_len * TRAINING.global_batch
    forward = tokens * (GPT.layers * (2 * GPT.layer_matrix_params + 2 * GPT.hidden * TRAINING.seq_len)
                        + 2 * GPT.vocab * GPT.hidden)
    assert one.parts["compute"] == pytest.approx(3 * forward / 1e10, rel=1e-12)
    assert one.parts["total"] == pytest.approx(sum(v for k, v in one.parts.items() if k != "total"))
    faster = step_time(GPT, TRAINING, Layout(), _machine(matmul_flops={"float32": 2e10}))
    assert faster.parts["compute"] == pytest.approx(one.parts["compute"] / 2)


def test_the_steps_own_small_collectives_are_charged_at_their_groups_latency():
    """Outside the blocks each step issues small collectives (counted in the strategy's steps): the step agreement
    over the world, the token-mean loss's count over dp x cp and tp's vocabulary-parallel cross entropy (two) per
    micro-batch, cp's loss and logged values (two), the pipeline's results (two broadcasts), and per value logged
    with sync_dist Lightning's barrier and all-reduce over the replicas (under tp the loss gathered first)."""
    two, four = 1e-4, 2e-4  # _machine()'s latencies for groups of 2 and 4

    def collectives(layout, machine=None, **changes):
        return step_time(GPT, replace(TRAINING, **changes), layout, machine or _machine()).parts.get("comm_step", 0.0)

    assert collectives(Layout(dp=2, cp=2)) == pytest.approx(four + four + 2 * two + 2 * two)
    assert collectives(Layout(dp=2, cp=2), synced_logs=0) == pytest.approx(four + four + 2 * two)
    assert collectives(Layout(dp=2, cp=2), _machine(overlap=True)) == pytest.approx(four + 2 * two + 2 * two)
    assert collectives(Layout(pp=2, tp=2)) == pytest.approx(four + (2 * 4 + 1) * two + 2 * two)  # 4 micro-batches
    assert collectives(Layout(pp=2, tp=2), microbatches=2) == pytest.approx(four + (2 * 2 + 1) * two + 2 * two)
    assert collectives(Layout()) == 0.0
    with pytest.raises(PlanError, match="synced_logs=-1"):
        Training(seq_len=8, global_batch=2, synced_logs=-1)


def test_the_command_line_counts_the_synced_logs_it_is_given(tmp_path, capsys):
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(_machine().as_dict()))
    args = ["--devices", "2", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "64", "--seq", "32",
            "--global-batch", "4", "--machine", str(machine), "--json"]
    parts = {}
    for synced in (0, 3):
        assert main([*args, "--synced-logs", str(synced)]) == 0
        layouts = json.loads(capsys.readouterr().out)["layouts"]
        parts[synced] = next(est["step_seconds"] for est in layouts if est["layout"]["dp"] == 2)
    # dp=2: the step agreement (1) and the token count (1) either way, and a barrier and an all-reduce per value
    assert parts[0]["comm_step"] == pytest.approx(2 * 1e-4)
    assert parts[3]["comm_step"] == pytest.approx((2 + 2 * 3) * 1e-4)


def test_a_pipeline_too_deep_for_the_default_micro_batches_runs_pp_of_them_when_timed():
    """A global batch of 4 cannot split into pp=4's default 8 micro-batches; timed, the planner (and so
    layout="auto") considers the micro-batch counts the user left open, and pp=4 runs 4; untimed it is refused."""
    training = Training(seq_len=64, global_batch=4)
    timed = {est.layout: est for est in plan(GPT, training, 4, machine=_machine())}
    assert timed[Layout(pp=4)].training.microbatches == 4
    assert Layout(pp=4) not in {est.layout for est in plan(GPT, training, 4)}
    assert timed.keys() > {Layout(dp=4), Layout(dp=2, pp=2)}


def test_every_block_of_every_micro_batch_pays_the_blocks_fixed_cost():
    """A block's forward and backward cost a measured time whatever its size (launches, dispatch, autograd):
    charged per block of the longest pipeline rank and per micro-batch, a third again per recomputed block."""
    def compute(layout, machine, **changes):
        return step_time(GPT, replace(TRAINING, **changes), layout, machine).parts

    plain, fixed = _machine(), _machine(block_fixed_s={"float32": 1e-3})
    assert compute(Layout(), fixed)["compute"] == pytest.approx(compute(Layout(), plain)["compute"] + 4 * 1e-3)
    # pp=2: two blocks per rank, four micro-batches (bf16 takes fp32's figure where its own was not measured)
    assert compute(Layout(pp=2), fixed)["compute"] == pytest.approx(compute(Layout(pp=2), plain)["compute"] + 8e-3)
    assert compute(Layout(pp=2), fixed, precision="bf16-mixed")["compute"] == pytest.approx(
        compute(Layout(pp=2), plain, precision="bf16-mixed")["compute"] + 8e-3)
    full = compute(Layout(), fixed, activation_checkpointing="full")["recompute"]
    assert full == pytest.approx(compute(Layout(), plain, activation_checkpointing="full")["recompute"] + 4 * 1e-3 / 3)
    assert Machine.from_dict(fixed.as_dict()) == fixed


def test_a_measured_block_curve_sets_the_compute_rate_at_the_layouts_width():
    curve = _machine(block_flops={"float32": {128: 2e9, 512: 8e9}})
    assert curve.flops("32-true", 256) == pytest.approx(4e9)  # halfway in log width, geometric in rate
    assert curve.flops("32-true", 64) == 2e9 and curve.flops("32-true", 4096) == 8e9  # the nearest end
    assert _machine().flops("32-true", 256) == 1e10  # no curve: the bare matmul's rate
    tp2 = step_time(GPT, TRAINING, Layout(tp=2), curve)  # a rank's width is hidden / tp = 128
    one = step_time(GPT, TRAINING, Layout(), curve)
    assert tp2.parts["compute"] == pytest.approx(one.parts["compute"] / 2 * 4e9 / 2e9)
    assert Machine.from_dict(curve.as_dict()) == curve


def test_tp_pays_four_all_reduces_per_block_and_micro_batch_at_the_links_latency_and_bandwidth():
    result = step_time(GPT, TRAINING, Layout(tp=2), _machine())
    count = 4 * GPT.layers + 1
    activation = TRAINING.seq_len * TRAINING.global_batch * GPT.hidden * 4
    assert result.parts["comm_tp"] == pytest.approx(count * 1e-4 + count * activation / 1e9, rel=1e-12)


def test_fsdp_gathers_and_reduce_scatters_at_their_own_measured_links():
    """Per unit (blocks and the root), two gathers of its parameters and a reduce-scatter of its gradients, each at
    the link measured for that op; without them, at the all-reduce's."""
    ops = {"all_gather": {2: Link(3e-4, 5e8)}, "reduce_scatter": {2: Link(5e-4, 2.5e8)}}
    own = step_time(GPT, TRAINING, Layout(dp_shard=2), _machine(op_links=ops)).parts["comm_dp_shard"]
    units, half = GPT.layers + 1, GPT.params * 4 / 2  # what one rank of two sends of the whole model
    assert own == pytest.approx(2 * units * 3e-4 + 2 * half / 5e8 + units * 5e-4 + half / 2.5e8, rel=1e-12)
    proxy = step_time(GPT, TRAINING, Layout(dp_shard=2), _machine()).parts["comm_dp_shard"]
    assert proxy == pytest.approx(3 * units * 1e-4 + 3 * half / 1e9, rel=1e-12)
    assert _machine(op_links=ops).link(4, op="all_gather") == Link(3e-4 * 2, 5e8)  # beyond the sizes measured
    assert Machine.from_dict(_machine(op_links=ops).as_dict()) == _machine(op_links=ops)


def test_the_bubble_shrinks_with_micro_batches_and_interleaving():
    bubbles = [step_time(GPT, Training(256, 16, microbatches=m), Layout(pp=2), _machine()).bubble for m in (2, 4, 8)]
    assert bubbles == pytest.approx([1 / 3, 1 / 5, 1 / 9])
    interleaved = step_time(GPT, Training(256, 16, microbatches=4, pp_schedule="interleaved_1f1b"), Layout(pp=2),
                            _machine()).bubble
    assert interleaved == pytest.approx(1 / 9)


def test_checkpointing_recomputes_and_overlap_hides_the_gradient_all_reduce():
    plain = step_time(GPT, TRAINING, Layout(dp=4), _machine(), bucket_mb=0.5)
    full = step_time(GPT, Training(256, 8, activation_checkpointing="full"), Layout(dp=4), _machine())
    assert plain.parts["recompute"] == 0 and full.parts["recompute"] > 0.2 * full.parts["compute"]
    hidden = step_time(GPT, TRAINING, Layout(dp=4), _machine(overlap=True), bucket_mb=0.5)
    assert hidden.parts["comm_dp"] < plain.parts["comm_dp"]


def test_each_block_and_micro_batch_pays_the_measured_cost_of_its_dimensions():
    costs = {"tp": {2: 0.01, 8: 0.04}, "cp": {2: 0.02}, "dp_shard": {2: 0.005}, "pp": {2: 0.003}}
    machine = _machine(overheads=costs)
    assert machine.overhead("tp", 4) == pytest.approx(0.025)  # halfway in log2 of the group size
    assert machine.overhead("cp", 4) == 0.02 and machine.overhead("dp_shard", 1) == 0.0  # the nearest; no group
    assert _machine().overhead("tp", 2) == 0.0  # nothing measured: nothing charged
    training = Training(256, 16, microbatches=4)
    tp_cp = step_time(GPT, training, Layout(pp=2, cp=2, tp=2), machine)
    layers, m = GPT.layers // 2, 4  # the stage's blocks, each once per micro-batch
    assert tp_cp.parts["overhead_tp"] == pytest.approx(0.01 * layers * m)
    assert tp_cp.parts["overhead_cp"] == pytest.approx(0.02 * layers * m)
    assert tp_cp.parts["overhead_pp"] == pytest.approx(0.003 * m)  # the schedule, per micro-batch and stage
    interleaved = step_time(GPT, Training(256, 16, microbatches=4, pp_schedule="interleaved_1f1b"), Layout(pp=2),
                            machine)
    assert interleaved.parts["overhead_pp"] == pytest.approx(0.003 * m * 2)  # two stages per rank
    bare = step_time(GPT, training, Layout(pp=2, cp=2, tp=2), _machine())
    assert "overhead_tp" not in bare.parts
    assert tp_cp.total - bare.total == pytest.approx((0.08 + 0.16 + 0.012) / (1 - bare.bubble))  # the bubble too
    sharded = step_time(GPT, TRAINING, Layout(dp_shard=2), machine)
    assert sharded.parts["overhead_dp_shard"] == pytest.approx(0.005 * (GPT.layers + 1))  # each FSDP unit
    # a correction below 0 (the all-reduce's latency over-charging tp's own) takes back at most tp's collectives
    generous = step_time(GPT, TRAINING, Layout(tp=2), _machine(overheads={"tp": {2: -1.0}}))
    assert generous.parts["overhead_tp"] == pytest.approx(-generous.parts["comm_tp"])
    assert Machine.from_dict(machine.as_dict()) == machine


def test_a_correction_of_fsdps_collectives_takes_nothing_from_the_pipelines_bubble():
    """FSDP's collectives are not in a micro-batch's stage time, so a measured correction below 0 of them (which
    had made the bubble negative at 8 processes) lowers the step but leaves the bubble as it is without it."""
    training, layout = Training(256, 16, microbatches=2), Layout(dp_shard=2, pp=2)
    bare = step_time(GPT, training, layout, _machine())
    corrected = step_time(GPT, training, layout, _machine(overheads={"dp_shard": {2: -1.0}}))
    assert corrected.parts["overhead_dp_shard"] == pytest.approx(-corrected.parts["comm_dp_shard"])
    assert corrected.parts["bubble"] == pytest.approx(bare.parts["bubble"]) and bare.parts["bubble"] > 0
    assert corrected.total == pytest.approx(bare.total - bare.parts["comm_dp_shard"])


def test_a_measured_optimizer_step_replaces_passes_over_the_memory_bandwidth():
    passes = step_time(GPT, TRAINING, Layout(dp_shard=2), _machine())
    measured = step_time(GPT, TRAINING, Layout(dp_shard=2), _machine(optimizer_seconds={"adamw": 1e-8, "sgd": 1e-9}))
    params = GPT.params  # the whole model's, half of it on each rank of dp_shard=2
    assert measured.parts["memory_bound"] - passes.parts["memory_bound"] == pytest.approx(
        1e-8 * params / 2 - 7 * params * 4 / 2 / 1e10, rel=1e-3)
    sgd = step_time(GPT, Training(256, 8, optimizer="sgd"), Layout(dp_shard=2), _machine(optimizer_seconds={"sgd": 1e-9}))
    assert sgd.parts["memory_bound"] < measured.parts["memory_bound"]


def test_a_measured_concurrency_replaces_ranks_over_cores_in_the_spread():
    shared = step_time(GPT, TRAINING, Layout(dp=4), _machine(cores_per_node=2))
    measured = step_time(GPT, TRAINING, Layout(dp=4), _machine(cores_per_node=2, concurrency=2.5))
    waits = shared.parts["comm_step"]  # the step's small collectives: waits, at their measured latency
    assert measured.shared_cores and measured.total == pytest.approx((shared.total - waits) * 2.5 / 2 + waits)


def test_ranks_that_share_cores_spread_their_work_over_them():
    dedicated = step_time(GPT, TRAINING, Layout(dp=4), _machine())
    shared = step_time(GPT, TRAINING, Layout(dp=4), _machine(cores_per_node=2))
    work = sum(v for k, v in dedicated.parts.items() if k not in ("total", "bubble", "comm_step"))
    # the step's small collectives are waits whose measured latency already has every rank running: not spread
    assert shared.shared_cores and shared.total == pytest.approx(2 * work + dedicated.parts["comm_step"])
    # a pipeline's bubble is waited for on top: the stages' warm-up and cool-down run one after another
    alone = step_time(GPT, TRAINING, Layout(pp=4), _machine())
    pipeline = step_time(GPT, TRAINING, Layout(pp=4), _machine(cores_per_node=2))
    work = sum(v for k, v in alone.parts.items() if k not in ("total", "bubble", "comm_step"))
    assert alone.parts["bubble"] > 0 and pipeline.shared_cores
    assert pipeline.total == pytest.approx(2 * work + alone.parts["comm_step"] + alone.parts["bubble"])


def test_the_planner_ranks_by_predicted_time_and_checkpoints_only_where_memory_needs_it():
    big = Model.from_sizes(layers=8, hidden=1024, heads=8, vocab=4096)
    training = Training(seq_len=2048, global_batch=8)
    roomy = plan(big, training, 4, 64 * 2**30, machine=_machine())
    assert [est.step.total for est in roomy] == sorted(est.step.total for est in roomy)
    assert all(est.training.activation_checkpointing == "none" for est in roomy)
    tight_budget = sorted(est.memory["total"] for est in roomy)[0] * 0.6
    tight = plan(big, training, 4, tight_budget, machine=_machine())
    assert tight and all(est.fits for est in tight)
    assert any(est.training.activation_checkpointing != "none" for est in tight)
    assert all(est.memory["total"] <= tight_budget for est in tight)
    with pytest.raises(PlanError, match="no layout fits"):
        plan(big, training, 4, 2**20, machine=_machine())


def test_the_runtimes_measured_memory_is_part_of_every_layouts_and_of_the_refusal():
    """Every layout's memory is its tensors' plus the runtime's bytes the probe measured, and a budget between
    the two is refused saying what the runtime takes."""
    runtime = 48 * 2**20
    bare = {est.layout: est for est in plan(GPT, TRAINING, 4, machine=_machine())}
    held = plan(GPT, TRAINING, 4, machine=_machine(runtime_bytes=runtime))
    for est in held:
        assert est.memory["runtime"] == runtime
        assert est.memory["total"] == pytest.approx(bare[est.layout].memory["total"] + runtime)
    smallest = min(est.memory["total"] for est in bare.values())
    assert plan(GPT, TRAINING, 4, smallest + runtime / 2, machine=_machine())
    with pytest.raises(PlanError, match=r"no layout fits .*, the runtime 48.00 MiB \(measured\)"):
        plan(GPT, TRAINING, 4, smallest + runtime / 2, machine=_machine(runtime_bytes=runtime))


def test_the_probe_measures_two_gloo_processes_and_caches_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    measured = subprocess.run([sys.executable, "-c", "import json; from lightning_4d.planner.calibration import"
                               " measure_here; print(json.dumps(measure_here(2, use_cache=False).as_dict()))"],
                              capture_output=True, text=True, timeout=180)
    assert measured.returncode == 0, measured.stderr[-3000:]
    machine = Machine.from_dict(json.loads(measured.stdout.splitlines()[-1]))
    assert machine.matmul_flops["float32"] > 1e8 and machine.memory_bandwidth > 1e8
    assert set(machine.links) == {2} and machine.links[2].latency_s > 0 and machine.links[2].bandwidth > 1e6
    assert {op: sorted(links) for op, links in machine.op_links.items()} == {"all_gather": [2], "reduce_scatter": [2]}
    assert all(link.latency_s > 0 and link.bandwidth > 1e6 for links in machine.op_links.values() for link in links.values())
    assert machine.overlap is False and machine.cores_per_node >= 1 and machine.devices_per_node == 2
    assert sorted(machine.block_flops["float32"]) == [64, 128, 256, 512]
    assert all(flops > 1e8 for flops in machine.block_flops["float32"].values())
    assert 0 < machine.block_fixed_s["float32"] < 0.1  # a 16-wide block on 16 tokens
    # each dimension's cost beyond the model's account, measured on the pair: finite, and never a whole second
    assert {axis: sorted(curve) for axis, curve in machine.overheads.items()} == {"tp": [2], "cp": [2], "dp_shard": [2],
                                                                                "pp": [2]}
    assert all(abs(cost) < 1.0 for curve in machine.overheads.values() for cost in curve.values())
    assert machine.concurrency >= 1.0
    assert set(machine.optimizer_seconds) == {"adamw", "sgd"} and all(0 < s < 1e-5 for s in machine.optimizer_seconds.values())
    assert 2**20 < machine.runtime_bytes < 2**30  # the fullest rank's growth while the dimensions ran
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1

    def no_launch(*args, **kwargs):
        raise AssertionError("measured again although the cache holds this machine")

    monkeypatch.setattr("torch.multiprocessing.start_processes", no_launch)
    assert calibration.measure_here(2) == machine


def test_calibrating_leaves_torchs_random_state_as_it_was(tmp_path):
    """``layout="auto"`` calibrates inside the user's run: the probe's tensors and modules must not move the
    generators the run draws from after it (a cold cache once changed a layout="auto" run's numbers in CI)."""
    code = ("import torch, torch.distributed as dist\n"
            "from lightning_4d.planner.calibration import calibrate\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "torch.manual_seed(7); before = torch.get_rng_state()\n"
            "calibrate('cpu', 1, use_cache=False)\n"
            "print('kept' if torch.equal(before, torch.get_rng_state()) else 'moved')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env={**script_env(), calibration.CACHE_ENV: str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "kept"


def test_the_command_line_prints_predicted_times_and_why_the_first_leads():
    args = [sys.executable, "-m", "lightning_4d.plan", "--devices", "4", "--layers", "4", "--hidden", "256",
            "--heads", "4", "--vocab", "512", "--seq", "256", "--global-batch", "8"]
    out = subprocess.run(args + ["--machine", "h100"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "step (s)" in out.stdout and "preset h100" in out.stdout
    assert "first: dp=" in out.stdout and "predicted" in out.stdout and "Next:" in out.stdout
    as_json = json.loads(subprocess.run(args + ["--machine", "h100", "--json"], capture_output=True, text=True,
                                        timeout=120).stdout)
    totals = [layout["step_seconds"]["total"] for layout in as_json["layouts"]]
    assert totals == sorted(totals)
    bad = subprocess.run(args + ["--machine", "nowhere.json"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--machine 'nowhere.json' is neither a preset (h100)" in bad.stderr
    many = subprocess.run(args[:4] + ["32"] + args[5:] + ["--measure"], capture_output=True, text=True, timeout=120)
    assert many.returncode != 0 and "--measure starts --devices (32) processes" in many.stderr


def test_the_command_line_runs_trials_through_the_strategy_and_refuses_what_cannot_run(capsys):
    """``--trials k``: the strategy's own ``layout="auto", layout_trials=k`` on --devices processes here (the
    example GPT as --module, random tokens): its k predicted fastest each measured, the per-sample fastest of
    them chosen and named. What cannot run is refused before any process starts."""
    args = ["--devices", "2", "--module", "lightning_4d.demos.gpt:GPT", "--init-args",
            '{"vocab_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}', "--seq", "32",
            "--global-batch", "8"]
    out = subprocess.run([sys.executable, "-m", "lightning_4d.plan", *args, "--trials", "2"], capture_output=True,
                         text=True, timeout=300, env=script_env())
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "a loader batch of 4 per replica" in text
    measured = re.findall(r"^  (dp=\d+ .*?tp=\d+) .*? measured step [0-9.e-]+ s \(([0-9.]+) ms/sample\)$", text, re.M)
    assert len(measured) == 2, text[-3000:]
    fastest = min(measured, key=lambda row: float(row[1]))[0]
    chosen = re.search(r"^chosen by the trials: (.*)$", out.stdout, re.M).group(1)
    sizes = dict(pair.split("=") for pair in chosen.split())
    assert fastest.startswith(f"dp={sizes['dp']} ") and f"tp={sizes['tp']}" in fastest, (fastest, chosen)
    if sizes["dp_shard"] != "1":
        assert f"dp_shard={sizes['dp_shard']}" in fastest, (fastest, chosen)
    sizes_only = ["--devices", "2", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "128", "--seq", "32",
                  "--global-batch", "8", "--trials", "2"]
    strategy = "lightning_4d.strategy:FourDStrategy"
    for argv, strategy, message in (([*args, "--trials", "0"], strategy, "--trials 0: give the number of layouts"),
                                    ([*args, "--trials", "2", "--json"], strategy, "which is text: drop --json"),
                                    ([*args, "--trials", "2", "--global-batch", "7"], strategy,
                                     "7 samples do not split over 2 devices"),
                                    (sizes_only, strategy, "--trials trains the model: give it as --module"),
                                    ([*args, "--trials", "2"], None, "run it as python -m lightning_4d.plan")):
        with pytest.raises(SystemExit) as exit:
            main(argv, strategy=strategy)
        assert exit.value.code == 2 and message in capsys.readouterr().err, argv
