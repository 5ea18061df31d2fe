"""PNG plots of a results.json: throughput per strategy, throughput vs ranks, peak memory, loss curves overlaid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

Record = dict[str, Any]
OK, BASE, BAD = "#4C72B0", "#DD8452", "#BBBBBB"


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the four PNGs into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        bar_plot(results, out_dir / "throughput.png", "tps_per_device", "tokens/s per device", "higher is better"),
        scaling_plot(results, out_dir / "scaling.png"),
        bar_plot(results, out_dir / "memory.png", "peak_memory_gib", "peak memory per rank (GiB)", "lower is better"),
        loss_plot(results, out_dir / "loss.png"),
        prediction_plot(results, out_dir / "prediction.png"),
    ]
    return paths


def subtitle(results: dict[str, Any]) -> str:
    bench, machine = results["bench"], results["machine"]
    where = (
        f"{machine['gpus']} x {machine['gpu_name']}"
        if machine["device"] == "cuda"
        else f"{machine['cpu_cores']} CPU cores shared by all ranks"
    )
    return f"{bench['flavor']}, {bench['dtype']}, global batch {bench['global_batch_size']} - {where}"


def bar_plot(results: dict[str, Any], path: Path, key: str, xlabel: str, better: str) -> Path:
    """One horizontal bar per run (failed runs shown, empty, with their status), the baseline highlighted."""
    records = results["runs"]
    baseline = results["bench"].get("baseline")
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(records) + 1.6))
    labels = [f"{r['label']} [{r['world_size']}r]" for r in records]
    values = [r[key] or 0.0 for r in records]
    colors = [BASE if r["name"] == baseline else OK if r["status"] == "ok" else BAD for r in records]
    y = list(range(len(records)))
    ax.barh(y, values, color=colors)
    spreads = [r.get("tps_per_device_ci") or r.get("tps_per_device_iqr") for r in records]  # CI, else (old) IQR
    if key == "tps_per_device":
        for i, r in enumerate(records):
            if r["status"] == "ok" and spreads[i]:
                ax.plot(spreads[i], [i, i], color="black", linewidth=1.2)
    highs = [(spreads[i] or [0.0, 0.0])[1] if key == "tps_per_device" else 0.0 for i in range(len(records))]
    top = max([*values, *highs], default=0.0) or 1.0
    for i, r in enumerate(records):
        text = f"{values[i]:,.3g}" if r["status"] == "ok" else r["status"]
        ax.text(max(values[i], highs[i]) + 0.01 * top, i, text, va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.18)
    whiskers = ", whiskers: confidence interval of the median" if key == "tps_per_device" else ""
    ax.set_xlabel(f"{xlabel} ({better}{whiskers})")
    ax.set_title(f"{xlabel} per strategy\n{subtitle(results)}", fontsize=10)
    return save(fig, path)


def scaling_plot(results: dict[str, Any], path: Path) -> Path:
    """Per scaling series: tokens/s per device vs ranks (flat = perfect scaling), and job tokens/s vs ranks."""
    by_name = {r["name"]: r for r in results["runs"]}
    fig, (per_device, job) = plt.subplots(1, 2, figsize=(11, 4.2))
    all_ranks: set[int] = set()
    for series, names in results["bench"].get("scaling", {}).items():
        rows = sorted(
            (by_name[n] for n in names if n in by_name and by_name[n]["status"] == "ok"), key=lambda r: r["world_size"]
        )
        if not rows:
            continue
        ranks = [r["world_size"] for r in rows]
        all_ranks.update(ranks)
        per_device.plot(ranks, [r["tps_per_device"] for r in rows], marker="o", label=series)
        per_device.plot(ranks, [rows[0]["tps_per_device"]] * len(rows), linestyle=":", color="gray")
        job.plot(ranks, [r["job_tps"] for r in rows], marker="o", label=series)
        ideal = [rows[0]["job_tps"] * n / ranks[0] for n in ranks]
        job.plot(ranks, ideal, linestyle=":", color="gray", label="ideal (linear)")
    cores = results["machine"].get("cpu_cores") if results["machine"]["device"] == "cpu" else None
    for ax, title in ((per_device, "tokens/s per device"), (job, "tokens/s, whole job")):
        style_scaling_axis(ax, title, sorted(all_ranks) or [1])
        if cores:
            ax.axvline(cores, color=BASE, linestyle="--", linewidth=1)
            ax.text(cores, ax.get_ylim()[1] * 0.02, f" {cores} cores: beyond, ranks share them", fontsize=8)
    fig.suptitle(f"Throughput vs number of ranks (higher is better)\n{subtitle(results)}", fontsize=10)
    return save(fig, path)


def style_scaling_axis(ax: Axes, title: str, ranks: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.minorticks_off()
    ax.set_xlabel("ranks")
    ax.set_ylabel(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def loss_plot(results: dict[str, Any], path: Path) -> Path:
    """All runs' loss curves overlaid, one column per sequence length (each length is its own workload); below, each
    run's relative difference to its parity reference (the baseline), which the overlaid curves hide."""
    ok = [r for r in results["runs"] if r["status"] == "ok" and r["loss_curve"]]
    by_name = {r["name"]: r for r in ok}
    lengths = sorted({r["seq_len"] for r in ok}) or [results["bench"]["seq_len"]]
    fig, axes = plt.subplots(2, len(lengths), figsize=(5.5 * len(lengths), 6.5), squeeze=False, sharex="col")
    for col, seq in enumerate(lengths):
        curves, diffs = axes[0][col], axes[1][col]
        curves.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
        for r in (r for r in ok if r["seq_len"] == seq):
            steps, losses = zip(*r["loss_curve"], strict=True)
            (line,) = curves.plot(steps, losses, marker=".", linewidth=1, alpha=0.8, label=r["label"])
            ref = by_name.get((r.get("parity") or {}).get("reference", ""))
            if ref is not None and ref["name"] != r["name"]:
                want = dict((step, loss) for step, loss in ref["loss_curve"])
                rel = [(s, max(abs(v - want[s]) / abs(want[s]), 1e-9)) for s, v in r["loss_curve"] if s in want]
                if rel:
                    diffs.plot(*zip(*rel, strict=True), marker=".", linewidth=1, color=line.get_color())
        curves.set_title(f"seq {seq}", fontsize=10)
        curves.set_ylabel("loss")
        diffs.set_yscale("log")
        diffs.set_ylabel("|loss - reference| / reference\n(1e-9: identical)", fontsize=9)
        diffs.set_xlabel("step")
        for ax in (curves, diffs):
            ax.grid(alpha=0.3)
        if curves.get_legend_handles_labels()[0]:
            curves.legend(fontsize=7)
    fig.suptitle(f"Loss per step, all strategies (same model, data and global batch)\n{subtitle(results)}", fontsize=10)
    return save(fig, path)


def prediction_plot(results: dict[str, Any], path: Path) -> Path:
    """Predicted (planner, leave-one-out) vs measured tokens/s per device, log-log, with y = x and a +-25 % band."""
    rows = [r for r in results["runs"] if r["status"] == "ok" and r.get("predicted_tps_per_device")]
    fig, ax = plt.subplots(figsize=(7, 6))
    if not rows:
        ax.text(0.5, 0.5, "no prediction (too few runs, or --hardware none)", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return save(fig, path)
    measured = [r["tps_per_device"] for r in rows]
    predicted = [r["predicted_tps_per_device"] for r in rows]
    for r, x, y in zip(rows, measured, predicted, strict=True):
        emulated = r.get("flags", {}).get("float8_emulate", False)
        ci = r.get("tps_per_device_ci") or [x, x]
        ax.errorbar(x, y, xerr=[[x - ci[0]], [ci[1] - x]], fmt="x" if emulated else "o", color=BAD if emulated else OK)
        ax.annotate(r["name"], (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    low, high = min(measured + predicted) / 1.5, max(measured + predicted) * 1.5
    ax.plot([low, high], [low, high], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([low, high], [low / 1.25, high / 1.25], [low * 1.25, high * 1.25], color="gray", alpha=0.15,
                    label="within 25 %")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured tokens/s per device (median, CI whiskers)")
    ax.set_ylabel("predicted tokens/s per device (planner, leave-one-out)")
    loo = results.get("prediction") or {}
    error = loo.get("median_abs_error")
    note = "" if error is None else f"; median |error| {error:.0%} ({loo.get('runs_scored')} runs, x: not scored)"
    ax.set_title(f"Planner vs measurement{note}\n{subtitle(results)}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    return save(fig, path)


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
