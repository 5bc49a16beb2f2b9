"""Markdown tables and PNG plots of benchmark results, one of each per benchmark, from the JSON payloads
the scripts write: each script prints its table, ``python -m bench`` also draws the plots. Matplotlib (the
``bench`` extra) is imported only to draw."""

import statistics
from pathlib import Path

MIB = 2**20


def _rows(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _dp(payload: dict) -> str:
    def rounds(values):
        return ", ".join(f"{v:.4f}" for v in values) if values else "-"

    rows = [[name, f"{r['step_s']:.4f}", f"{r['tokens_per_s']:.0f}", rounds(r.get("step_s_rounds")),
             rounds(r.get("cpu_s_rounds"))] for name, r in payload["results"].items()]
    text = (_rows(["strategy", "step time, best round (s)", "tokens/s", "wall per round (s)",
                   "CPU time per step per round, rank 0 (s)"], rows)
            + f"\n\nFourD / DDP step time: **{payload['fourd_over_ddp_step_time']:.3f}**")
    if "fourd_over_ddp_cpu_time" in payload:
        text += f", CPU time **{payload['fourd_over_ddp_cpu_time']:.3f}**"
    if payload.get("fourd_gradient_buckets"):
        text += f"; FourD's gradient buckets: {payload['fourd_gradient_buckets']} (bucket_mb={payload['bucket_mb']})"
    return text


def _tp(payload: dict) -> str:
    rows = [[name, f"{r['step_s']:.4f}", f"{r['tokens_per_s']:.0f}", f"{r['cpu_step_s']:.4f}",
             f"{r['last_train_loss']:.5f}"] for name, r in payload["results"].items()]
    return (_rows(["strategy", "step time (s)", "tokens/s", "CPU time per step, rank 0 (s)",
                   "train loss after the last step"], rows)
            + f"\n\nFourD / hand-written: step time **{payload['fourd_over_hand_written_step_time']:.3f}**,"
              f" CPU time **{payload['fourd_over_hand_written_cpu_time']:.3f}**")


def _overhead(row: dict, key: str) -> str:
    """``+4.1%``, with its interval where one was computed: ``+4.1% (+3.2% to +5.0%)``."""
    if key not in row:
        return ""
    low_high = row.get(f"{key}_interval")
    return f"{row[key]:+.1%}" + (f" ({low_high[0]:+.1%} to {low_high[1]:+.1%})" if low_high else "")


def _pp(payload: dict) -> str:
    rows = []
    for r in payload["results"]:
        hand = "by_hand_step_s" in r
        rows.append([str(r["pp"]), r["schedule"], str(r["microbatches"]), f"{r['fourd_step_s']:.3f}",
                     f"{r['fourd_bubble']:.2f}", "" if r["theory_bubble"] is None else f"{r['theory_bubble']:.2f}",
                     f"{r['by_hand_step_s']:.3f}" if hand else "", f"{r['by_hand_bubble']:.2f}" if hand else "",
                     *(_overhead(r, key) for key in (
                         "overhead_wall", "overhead_cpu", "overhead_wall_paired", "overhead_period_paired",
                         "overhead_wall_interleaved", "overhead_wall_unfused", "overhead_cpu_unfused",
                         "overhead_wall_paired_unfused", "overhead_wall_paired_control",
                         "overhead_period_paired_control", "overhead_wall_interleaved_control"))])
    return _rows(["pp", "schedule", "m", "step (s)", "bubble, measured", "bubble, theory", "by hand: step (s)",
                  "bubble", "overhead, wall", "overhead, CPU", "overhead, wall, paired", "overhead, period, paired",
                  "overhead, wall, step by step (95% interval)", "head unfused: overhead, wall",
                  "overhead, CPU", "overhead, wall, paired", "control (hand against hand): wall, paired",
                  "period, paired", "step by step (95% interval)"], rows)


def _cp_name(row: dict) -> str:
    if row["variant"] == "single":
        return "one process"
    return f"cp={row['processes']}, {row['variant']}" + (f", {row['layout']}" if "layout" in row else "")


def _cp(payload: dict) -> str:
    rows = [[str(r["seq"]), r.get("mask", "causal"), _cp_name(r), f"{r['peak_mib_per_rank']:.1f}",
             f"{r['memory_vs_single']:.2f}x" if "memory_vs_single" in r else "", f"{r['wall_s']:.2f}",
             f"{r['cpu_s_per_rank']:.2f}",
             f"{r['cpu_s_per_rank'] / r['cpu_s_fastest_rank']:.2f}" if r.get("cpu_s_fastest_rank") else "",
             f"{r['work_busiest_m']:.1f}M, {r['work_busiest_vs_idlest']:.2f}" if "work_busiest_m" in r else ""]
            for r in payload["results"]]
    return _rows(["tokens", "mask", "attention", "peak memory per rank (MiB)", "vs one process", "wall time (s)",
                  "CPU time per rank (s)", "slowest / fastest rank",
                  "attention work: busiest rank, / idlest"], rows)


def _memory(payload: dict) -> str:
    rows = [[str(r["width"]), f"{r['params'] / 1e6:.1f}M", r["layout"], str(r["processes"]),
             f"{r['measured_mib']:.0f}", f"{r['estimated_mib']:.0f}", f"{r['estimate_error']:+.0%}"]
            for r in payload["results"]]
    return _rows(["n_embd", "parameters", "layout", "processes", "measured peak, largest rank (MiB)",
                  "planner estimate (MiB)", "estimate vs measured"], rows)


def _scaling(payload: dict) -> str:
    rows = [[r["layout"], str(r["processes"]), f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}",
             f"{r['speedup']:.2f}x" if "speedup" in r else "", str(r.get("ideal_speedup_here", ""))]
            for r in payload["results"]]
    return _rows(["layout", "processes", "step time (s)", "tokens/s", "vs one process",
                  f"at most, on {payload['cores']} cores"], rows)


def _checkpoint(payload: dict) -> str:
    rows = [[r["layout"], str(r["processes"]), f"{r['save_s']:.2f}", f"{r['load_s']:.2f}",
             f"{r['load_other_layout_s']:.2f}" if "load_other_layout_s" in r else "",
             f"{r['max_rank_bytes'] / MIB:.1f}", f"{r['total_bytes'] / MIB:.1f}", f"{r['max_rank_vs_single']:.2f}x"]
            for r in payload["results"]]
    return _rows(["layout", "processes", "save (s)", "load (s)", "load the other layout's checkpoint (s)",
                  "largest rank writes (MiB)", "all ranks write (MiB)", "largest rank vs one process"], rows)


def _async_checkpoint(payload: dict) -> str:
    sync = {(r["layout"], r["round"]): r for r in payload["results"] if not r["async"]}
    rows = []
    for r in payload["results"]:
        base = sync[r["layout"], r["round"]]
        during = r["steps_during_write"]
        ratio = statistics.median(during) / base["step_median_s"] if during else None
        rss = [per for per in r["rss_gb"].values()]
        growth = max(per[f"after_{r['saves']}_saves"] / per["after_2_saves"] - 1 for per in rss)
        staging = max(per["after_2_saves"] - per["before_first_save"] for per in rss)
        rows.append([r["layout"], str(r["round"]), "async" if r["async"] else "sync", str(r["saves"]),
                     f"{r['held_median_s']:.3f} (max {r['held_max_s']:.2f})",
                     f"{r['held_median_s'] / base['held_median_s']:.1%}",
                     f"{r['rank_wait_median_s']:.3f}", f"{r['step_median_s']:.2f}",
                     f"{ratio:.2f}x ({len(during)} steps)" if ratio else "", f"{staging:.2f}", f"{growth:+.1%}"])
    return _rows(["layout", "round", "saves", "n", "step held per save, median s", "of sync",
                  "one rank's wait, median s", "step median s", "steps during a write vs sync median",
                  "memory added by 2 saves (GB, max rank)", "RSS after the last save vs after 2"], rows)


def _async_checkpoint_scaling(payload: dict) -> str:
    rows = [[str(r["processes"]), "on" if r["plan_caching"] else "off", f"{r['save_s']:.2f}", f"{r['load_s']:.2f}"]
            for r in payload["results"]]
    return _rows(["processes", "plan caching", "save s (best)", "load s (best)"], rows)


def _async_checkpoint_writers(payload: dict) -> str:
    rows = [[r["kind"], str(r["mb_per_rank"]), f"{r['blocked_s']:.3f}", f"{r['write_s']:.1f}",
             f"{r['baseline_step_s']:.3f}", f"{r['during_write_step_s']:.3f}" if r["during_write_step_s"] else "",
             f"{r['during_write_step_s'] / r['baseline_step_s']:.2f}x" if r["during_write_step_s"] else ""]
            for r in payload["results"]]
    return _rows(["writer", "MB per rank", "save call held (s)", "write took (s)", "step without a write (s)",
                  "step during a write (s)", "ratio"], rows)


def _activation_checkpointing(payload: dict) -> str:
    rows = payload["rows"]
    none = {r["seq"]: r for r in rows if r["mode"] == "none"}
    return _rows(["seq", "mode", "peak MiB", "of none", "CPU s/step", "of none"],
                 [[str(r["seq"]), r["mode"], f"{r['peak_mib']:.1f}", f"{r['peak_mib'] / none[r['seq']]['peak_mib']:.2f}",
                   f"{r['cpu_s']:.3f}", f"{r['cpu_s'] / none[r['seq']]['cpu_s']:.2f}"] for r in rows])


def _compile(payload: dict) -> str:
    return _rows(["layout", "eager step s", "compiled step s", "speed-up (wall)", "eager CPU s", "compiled CPU s",
                  "speed-up (CPU)", "first compiled step s", "round spread"],
                 [[r["layout"], f"{r['eager_step_s']:.3f}", f"{r['compiled_step_s']:.3f}", f"{r['speedup']:.2f}x",
                   f"{r['eager_cpu_s']:.3f}", f"{r['compiled_cpu_s']:.3f}", f"{r['cpu_speedup']:.2f}x",
                   f"{r['compiled_first_step_s']:.1f}", f"{r['spread']:.0%}"] for r in payload["rows"]])


def _cp_step_check(payload: dict) -> str:
    return _rows(["tokens per sequence", "round", "cp_check", "first step s (wall)", "first step CPU s",
                  "second step s (wall)", "peak MiB per rank"],
                 [[str(r["seq"]), str(r["round"]), "on" if r["check"] else "off", f"{r['first_step_wall_s']:.2f}",
                   f"{r['first_step_cpu_s']:.2f}", f"{r['second_step_wall_s']:.2f}", f"{r['peak_mib']:.0f}"]
                  for r in payload["results"]])


def _logits(payload: dict) -> str:
    rows = []
    for r in payload["results"]:
        head = [r["layout"], str(r["seq"]), str(r["vocab"]), "fused" if r["fused"] else "unfused", str(r["round"])]
        if "skipped" in r:
            rows.append(head + ["not run: " + r["skipped"], "", ""])
        else:
            rows.append(head + [f"{r['peak_mib']:.0f}", f"{r['step_s']:.3f}", f"{r['cpu_s']:.3f}"])
    text = _rows(["layout", "tokens", "vocabulary", "LM-head loss", "round", "peak growth MiB per rank",
                  "step s (wall)", "CPU s/step"], rows)
    goals = [[spec, f"{g['peak_ratio']:.2f} (≤ {g['peak_goal']}: {'met' if g['peak_met'] else '**missed**'})",
              f"{g['step_ratio']:.2f} (≤ {g['step_goal']}: {'met' if g['step_met'] else '**missed**'})"]
             for spec, g in payload.get("goals", {}).items()]
    if goals:
        text += "\n\nAt 4,096 tokens and a vocabulary of 32,000 (medians over rounds):\n\n" + _rows(
            ["layout", "fused peak / unfused one-device peak", "fused step / unfused step"], goals)
    return text


def _goal(ratio: float | None, goal: float | None, met: bool | None, excess_gb: float) -> str:
    if goal is None:
        return "" if ratio is None else f"{ratio:.2f}"
    excess = f"{excess_gb:.3f}" if excess_gb < 0.01 else f"{excess_gb:.2f}"
    return f"{ratio:.2f} (≤ {goal}: {'met' if met else f'**missed** by {excess} GB'})"


def _big_model(payload: dict) -> str:
    gb = 1e9
    rows = []
    for r in payload["rows"]:
        single = r["train_growth"] / r["train_vs_single"] if r["train_vs_single"] else None
        allowed = (r["setup_goal"] or 0) * r["model_bytes"]
        train_excess = (r["train_growth"] - (r["train_goal"] or 0) * (single or 0)) / gb
        rows.append([r["size"], r["layout"], r["build"], str(r["processes"]), f"{r['before'] / gb:.2f}",
                     f"{r.get('before_construction', r['before']) / gb:.2f}", f"{r['setup_growth'] / gb:.2f}",
                     f"{r.get('setup_growth_from_start', r['setup_growth']) / gb:.2f}",
                     f"{r['setup_anon_growth'] / gb:.2f} / {r['setup_file_growth'] / gb:.2f}",
                     _goal(r["setup_over_model"], r["setup_goal"], r["setup_met"], (r["setup_growth"] - allowed) / gb),
                     _goal(r["setup_anon_over_model"], r["setup_goal"], r["setup_anon_met"],
                           (r["setup_anon_growth"] - allowed) / gb),
                     f"{r['first_step_growth'] / gb:.2f}", f"{r['train_growth'] / gb:.2f}",
                     _goal(r["train_vs_single"], r["train_goal"], r["train_met"], train_excess),
                     f"{r['end_growth'] / gb:.2f}", f"{r['setup_s']:.1f}", f"{r['step_s']:.2f}",
                     f"{r['hf_load_s']:.2f}" if "hf_load_s" in r else "",
                     f"{r['torch_load_s']:.2f}" if "torch_load_s" in r else ""])
    return _rows(["model", "layout", "build", "ranks", "at start (GB)", "before construction (GB)", "setup peak +GB",
                  "setup peak +GB from start", "anon / file +GB",
                  "setup / model bytes", "anon / model bytes", "first step peak +GB", "step peak +GB", "step peak / one process",
                  "end of step +GB", "setup s", "step s", "HF dir load s", "torch.load s"], rows)


def _step_time(payload: dict) -> str:
    rows = []
    for r in payload["results"]:
        sizes = " ".join(f"{k}={v}" for k, v in r["sizes"].items() if v != 1 or k == "dp")
        if "refused" in r:
            rows.append([r["model"], sizes, "", "", "", "", "", "", "", f"refused: {r['refused'][:60]}"])
            continue
        per_sample = r["step_s"] / r["global_batch"] * 1e3
        auto = f"auto (layout_trials={r.get('layout_trials', 1)}): " if r.get("auto") else ""
        budget = f" / {r['memory_per_device'] / 2**20:.0f}" if r.get("memory_per_device") else ""
        rows.append([r["model"], auto + sizes, r.get("activation_checkpointing", ""),
                     f"{r['predicted_s']:.3f}" if "predicted_s" in r else "", f"{r['step_s']:.3f}",
                     " / ".join(f"{s:.3f}" for s in r.get("rounds_s", [])), f"{per_sample:.2f}",
                     f"{r['error']:+.0%}" if "error" in r else "",
                     f"{r['predicted_memory_bytes'] / 2**20:.0f}" if "predicted_memory_bytes" in r else "",
                     f"{r['peak_growth_bytes'] / 2**20:.0f}{budget}" if "peak_growth_bytes" in r else ""])
    return _rows(["case", "layout", "ac", "predicted step s", "measured step s (median)", "each round",
                  "measured ms/sample", "error", "predicted MiB", "measured peak +MiB / budget"], rows)


def _log2_x(ax, values) -> None:
    """A base-2 log x axis labelled at exactly ``values`` (process counts, micro-batches, lengths)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(values)))
    ax.set_xticklabels([str(v) for v in sorted(set(values))])
    ax.minorticks_off()


TABLES = {"dp": _dp, "tp": _tp, "pp": _pp, "cp": _cp, "memory": _memory, "scaling": _scaling,
          "checkpoint": _checkpoint, "activation_checkpointing": _activation_checkpointing, "compile": _compile,
          "big_model": _big_model, "cp_step_check": _cp_step_check, "logits": _logits,
          "async_checkpoint": _async_checkpoint, "async_checkpoint_scaling": _async_checkpoint_scaling,
          "async_checkpoint_writers": _async_checkpoint_writers, "step_time": _step_time}


def table(name: str, payload: dict) -> str:
    return TABLES[name](payload)


def _plot_pp(payload: dict, figure):
    by_pp = sorted({r["pp"] for r in payload["results"]})
    for index, pp in enumerate(by_pp):
        ax = figure.add_subplot(1, len(by_pp), index + 1)
        rows = [r for r in payload["results"] if r["pp"] == pp]
        for schedule in dict.fromkeys(r["schedule"] for r in rows):
            mine = [r for r in rows if r["schedule"] == schedule]
            ax.plot([r["microbatches"] for r in mine], [r["fourd_bubble"] for r in mine], "o-", label=schedule)
        ms = sorted({r["microbatches"] for r in rows})
        ax.plot(ms, [(pp - 1) / (m + pp - 1) for m in ms], "k--", label="theory for GPipe, 1F1B: (p-1)/(m+p-1)")
        ax.set(title=f"pp={pp}", xlabel="micro-batches m", ylabel="bubble fraction, measured")
        _log2_x(ax, ms)
        ax.legend(fontsize=7)


def _plot_cp(payload: dict, figure):
    rows = payload["results"]
    for index, (key, label) in enumerate((("peak_mib_per_rank", "peak memory per rank (MiB)"),
                                          ("cpu_s_per_rank", "CPU time per rank (s)"))):
        ax = figure.add_subplot(1, 2, index + 1)
        for name in dict.fromkeys(_cp_name(r) for r in rows):
            mine = [r for r in rows if _cp_name(r) == name]
            ax.plot([r["seq"] for r in mine], [r[key] for r in mine], "o-", label=name)
        ax.set(xlabel="sequence length (tokens)", ylabel=label, yscale="log")
        _log2_x(ax, [r["seq"] for r in rows])
        ax.legend(fontsize=7)


def _plot_memory(payload: dict, figure):
    widths = sorted({r["width"] for r in payload["results"]})
    for index, width in enumerate(widths):
        ax = figure.add_subplot(1, len(widths), index + 1)
        rows = [r for r in payload["results"] if r["width"] == width]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["measured_mib"] for r in rows], 0.4, label="measured (largest rank)")
        ax.bar([i + 0.2 for i in x], [r["estimated_mib"] for r in rows], 0.4, label="planner estimate")
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["layout"] for r in rows], rotation=45, fontsize=7)
        ax.set(title=f"n_embd {width} ({rows[0]['params'] / 1e6:.1f}M params)", ylabel="MiB per rank")
        ax.legend(fontsize=7)


def _plot_scaling(payload: dict, figure):
    ax = figure.add_subplot(1, 1, 1)
    rows = payload["results"]
    dp = [r for r in rows if r["layout"].startswith("dp") and r["layout"][2:].isdigit()]
    ax.plot([r["processes"] for r in dp], [r["tokens_per_s"] for r in dp], "o-", label="FourDStrategy(dp=n)")
    for r in rows:
        if r not in dp:
            ax.plot(r["processes"], r["tokens_per_s"], "s", label=r["layout"])
    one = [r for r in rows if r["processes"] == 1]
    if one:
        counts = sorted({r["processes"] for r in rows})
        ax.plot(counts, [one[0]["tokens_per_s"] * n for n in counts], ":", color="gray", label="linear")
        ax.plot(counts, [one[0]["tokens_per_s"] * min(n, payload["cores"]) for n in counts], "--", color="gray",
                label=f"at most, on {payload['cores']} cores")
    ax.set(xlabel="processes", ylabel="tokens/s", yscale="log")
    _log2_x(ax, [r["processes"] for r in rows])
    ax.legend(fontsize=7)


def _plot_checkpoint(payload: dict, figure):
    ax = figure.add_subplot(1, 1, 1)
    single, sharded = payload["results"]
    per_rank = sharded["distcp_bytes_per_rank"]
    ax.bar(range(len(per_rank)), [b / MIB for b in per_rank], label=f"{sharded['layout']}: rank's file")
    ax.axhline(single["total_bytes"] / MIB, color="k", linestyle="--", label="one process: the whole checkpoint")
    ax.set(xlabel="rank", ylabel="MiB written", xticks=list(range(len(per_rank))),
           title=f"save {sharded['save_s']:.2f} s vs {single['save_s']:.2f} s,"
                 f" load {sharded['load_s']:.2f} s vs {single['load_s']:.2f} s")
    ax.legend(fontsize=7)


def _plot_activation_checkpointing(payload: dict, figure):
    rows = payload["rows"]
    for index, (key, label) in enumerate((("peak_mib", "peak memory of a step (MiB)"), ("cpu_s", "CPU s per step"))):
        ax = figure.add_subplot(1, 2, index + 1)
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([r["seq"] for r in mine], [r[key] for r in mine], "o-", label=mode)
        ax.set(xlabel="sequence length (tokens)", ylabel=label)
        _log2_x(ax, [r["seq"] for r in rows])
        ax.legend(fontsize=7)


def _plot_compile(payload: dict, figure):
    ax = figure.add_subplot(1, 1, 1)
    rows = payload["rows"]
    at = range(len(rows))
    ax.bar([i - 0.2 for i in at], [r["eager_cpu_s"] for r in rows], 0.4, label="eager")
    ax.bar([i + 0.2 for i in at], [r["compiled_cpu_s"] for r in rows], 0.4, label="compile=True")
    ax.set(xticks=list(at), xticklabels=[r["layout"] for r in rows], ylabel="CPU s per step (rank 0)",
           title="the example GPT, 2 processes, CPU inductor")
    ax.legend(fontsize=7)


def _plot_sharded_memory(payload: dict, figure):
    ax = figure.add_subplot(1, 1, 1)
    rows = payload["results"]
    at = range(len(rows))
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer"):
        values = [r["per_rank_mib"][part] for r in rows]
        ax.bar(list(at), values, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xticks=list(at), xticklabels=[r["layout"] for r in rows], ylabel="MiB per rank (largest rank)",
           title=f"model state per rank, example GPT ({rows[0]['params'] / 1e6:.1f}M parameters, AdamW, fp32)")
    ax.legend(fontsize=7)


def _plot_experts(payload: dict, figure):
    rows = payload["results"]
    at = list(range(len(rows)))
    ax = figure.add_subplot(1, 2, 1)
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer"):
        values = [r["per_rank_mib"][part] for r in rows]
        ax.bar(at, values, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    single = next((r["total_mib"] for r in rows if r["layout"] == "single"), None)
    if single:
        ax.axhline(0.35 * single, color="k", lw=0.8, ls="--", label="0.35 x one process (#30's goal at ep=4)")
    ax.set_ylim(0, 1.4 * max(bottom))
    ax.set(xticks=at, xticklabels=[r["layout"] for r in rows], ylabel="MiB per rank (largest rank)",
           title=f"model state per rank, 8-expert Mixtral ({rows[0]['params'] / 1e6:.2f}M, AdamW fp32)")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    ax = figure.add_subplot(1, 2, 2)
    ax.bar([i - 0.2 for i in at], [r.get("ep_bytes", 0) / 1024 for r in rows], 0.4, label="expert parallelism (ep)")
    ax.bar([i + 0.2 for i in at], [r.get("allreduce_bytes", 0) / 1024 for r in rows], 0.4, label="grad all-reduce")
    ax.set(xticks=at, xticklabels=[r["layout"] for r in rows], ylabel="KiB per rank per step",
           title="traffic per rank per step")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)


def _plot_data_parallel_vs_lightning(payload: dict, figure):
    keys = (("wall_s", "wall s/step"), ("cpu_s", "CPU s/step"), ("peak_mib", "peak memory"))
    for index, (pair, result) in enumerate(payload["results"].items()):
        ax = figure.add_subplot(1, len(payload["results"]), index + 1)
        for offset, (key, label) in enumerate(keys):
            values = result["fourd_over_lightning"][key]["per_round"]
            ax.plot([offset] * len(values), values, "o", alpha=0.7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xticks=range(len(keys)), xticklabels=[label for _, label in keys], ylabel="FourD / Lightning",
               title={"replicated": "dp=2 vs DDPStrategy", "sharded": "dp_shard=2 vs ModelParallelStrategy"}.get(
                   pair, pair), xlim=(-0.5, len(keys) - 0.5))


def _plot_big_model(payload: dict, figure):
    sizes = list(dict.fromkeys(r["size"] for r in payload["rows"]))
    panels = (("setup_over_model", "setup peak growth / model bytes", "setup_goal"),
              ("train_vs_single", "step peak growth / one process's", "train_goal"))
    for row_index, size in enumerate(sizes):
        rows = [r for r in payload["rows"] if r["size"] == size]
        layouts = list(dict.fromkeys(r["layout"] for r in rows))
        for column, (key, label, goal) in enumerate(panels):
            ax = figure.add_subplot(len(sizes), 2, 2 * row_index + column + 1)
            for offset, build in ((-0.2, "whole"), (0.2, "meta")):
                mine = {r["layout"]: r for r in rows if r["build"] == build}
                at = [i for i, spec in enumerate(layouts) if spec in mine and mine[spec][key] is not None]
                ax.bar([i + offset for i in at], [mine[layouts[i]][key] for i in at], 0.4, label=f"{build}-built")
                if key == "setup_over_model" and build == "meta":  # what the rank allocated, without mapped files
                    ax.bar([i + offset for i in at], [mine[layouts[i]]["setup_anon_over_model"] for i in at], 0.4,
                           fill=False, hatch="//", label="meta-built, allocations only")
                for i in at:
                    if mine[layouts[i]][goal] is not None:
                        ax.hlines(mine[layouts[i]][goal], i + offset - 0.2, i + offset + 0.2, colors="k")
            ax.set_xticks(range(len(layouts)))
            ax.set_xticklabels(layouts, fontsize=7)
            ax.set(title=f"{size} Llama (fp32): {label}", ylabel="ratio (black: #27's goal)")
            ax.title.set_fontsize(8)
            ax.legend(fontsize=7)


def _plot_logits(payload: dict, figure):
    rows = [r for r in payload["results"] if "skipped" not in r]
    vocabs = sorted({r["vocab"] for r in rows})
    for index, vocab in enumerate(vocabs):
        for row_index, (key, label) in enumerate((("peak_mib", "peak growth per rank (MiB)"),
                                                  ("step_s", "step time (s)"))):
            ax = figure.add_subplot(2, len(vocabs), row_index * len(vocabs) + index + 1)
            for spec in dict.fromkeys(r["layout"] for r in rows):
                for fused in (True, False):
                    mine = [r for r in rows if (r["layout"], r["vocab"], r["fused"]) == (spec, vocab, fused)]
                    seqs = sorted({r["seq"] for r in mine})
                    values = [statistics.median(r[key] for r in mine if r["seq"] == s) for s in seqs]
                    if seqs:
                        ax.plot(seqs, values, "o-" if fused else "x--",
                                label=f"{spec}, {'fused' if fused else 'unfused'}")
            ax.set(xlabel="tokens per sequence", ylabel=label, yscale="log", title=f"vocabulary {vocab}")
            _log2_x(ax, [r["seq"] for r in rows])
            ax.legend(fontsize=6)


PLOTS = {"pp": (_plot_pp, (9, 4)), "cp": (_plot_cp, (9, 4)), "memory": (_plot_memory, (11, 4)),
         "scaling": (_plot_scaling, (6, 4)), "checkpoint": (_plot_checkpoint, (6, 4)),
         "activation_checkpointing": (_plot_activation_checkpointing, (9, 4)), "compile": (_plot_compile, (6, 4)),
         "sharded_memory": (_plot_sharded_memory, (7, 4)), "experts": (_plot_experts, (11, 4)),
         "data_parallel_vs_lightning": (_plot_data_parallel_vs_lightning, (9, 4)),
         "big_model": (_plot_big_model, (10, 7)), "logits": (_plot_logits, (10, 7))}


def plot(name: str, payload: dict, path: Path) -> bool:
    """Draw ``name``'s plot into ``path``; False when that benchmark has none."""
    if name not in PLOTS:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draw, size = PLOTS[name]
    figure = plt.figure(figsize=size)
    draw(payload, figure)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return True
