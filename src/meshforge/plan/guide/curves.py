"""Throughput curves of the guide: predicted tokens/s per GPU vs GPU count, one curve per strategy family (the best
layout of the family in each cell) with its interval as a band, one PNG per model with a panel per sequence length;
the article's measured rows (plan/accuracy/published.py) and a `meshforge bench` results.json drawn on the same axes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshforge.config.io import ConfigError, load_config
from meshforge.plan.accuracy import published
from meshforge.plan.guide.guide import FAMILIES, family, family_of
from meshforge.plan.layout import layout_from_config

COLORS = dict(zip(FAMILIES, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))


def family_curves(
    cells: Sequence[dict[str, Any]], model: str, seq: int
) -> dict[str, list[tuple[int, float, float, float]]]:
    """{family: [(GPUs, tokens/s, low, high)]} of one model at one sequence length, GPU counts ascending."""
    out: dict[str, list[tuple[int, float, float, float]]] = {}
    for c in sorted(cells, key=lambda c: c["world"]):
        if c["model"] != model or c["seq_len"] != seq or c["best"] is None:
            continue
        for fam, est in c["families"].items():
            out.setdefault(fam, []).append((c["world"], est["tps"], est["tps_low"], est["tps_high"]))
    return {f: out[f] for f in FAMILIES if f in out}


def article_points() -> list[tuple[str, int, int, str, float, str]]:
    """(model, seq, GPUs, family, tokens/s, label) of every row of the article's tables."""
    out = []
    for run in published.article_runs():
        layout = layout_from_config(load_config(None, list(run.overrides)), run.world_size, impl="torchtitan")
        out.append((layout.flavor, layout.seq_len, run.world_size, family(layout), run.tps, run.name))
    return out


def bench_points(path: str) -> list[tuple[str, int, int, str, float, str]]:
    """The same tuples for every finished run of a `meshforge bench` results.json."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--with-results {path}: cannot read a bench results.json ({exc})") from None
    out = []
    for r in results.get("runs", []):
        if r.get("status") == "ok" and r.get("tps_per_device"):
            d = r["layout"]
            fam = family_of(d["tp"], d["pp"], d["cp"])
            out.append((r["flavor"], r["seq_len"], r["world_size"], fam, r["tps_per_device"], r["label"]))
    return out


def write_curves(cells: Sequence[dict[str, Any]], hardware: str, out: Path, results: str | None = None) -> list[Path]:
    """One PNG per model (a panel per sequence length); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(p, "*") for p in article_points()] + [(p, "s") for p in (bench_points(results) if results else [])]
    paths = []
    for model in dict.fromkeys(c["model"] for c in cells):
        seqs = sorted({c["seq_len"] for c in cells if c["model"] == model})
        fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs), 4), squeeze=False)
        for ax, seq in zip(axes[0], seqs, strict=True):
            for fam, rows in family_curves(cells, model, seq).items():
                w, mid, lo, hi = zip(*rows, strict=True)
                ax.plot(w, mid, marker="o", color=COLORS[fam], label=f"{fam} (predicted)")
                ax.fill_between(w, lo, hi, color=COLORS[fam], alpha=0.2)
            for (p_model, p_seq, world, fam, tps, label), marker in points:
                if p_model == model and p_seq == seq:
                    ax.scatter([world], [tps], marker=marker, s=120, color=COLORS[fam], edgecolor="black", zorder=3)
                    ax.annotate(label, (world, tps), fontsize=6, xytext=(4, 4), textcoords="offset points")
            ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s per GPU", title=f"{model}, seq {seq:,}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{model} on {hardware}: best layout per family (band: interval; star: article, square: bench)")
        fig.tight_layout()
        path = out / f"curves-{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
