"""The measured guide of a bench sweep: which strategy family won per model and rank count on this machine, beside
the one the planner's predictions for the same runs pick (the predicted guide, plan/guide/guide.py's families)."""

from __future__ import annotations

from typing import Any

from meshforge.plan.guide.guide import family_of


def _family(record: dict[str, Any]) -> str:
    d = record["layout"]
    return family_of(d["tp"], d["pp"], d["cp"])


def guide_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (flavor, seq, ranks): the measured winner and the predicted winner among the finished strategy runs."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in results.get("runs", []):
        if r.get("status") == "ok" and r.get("tps_per_device") and r.get("group") in ("strategy", "scaling"):
            groups.setdefault((r["flavor"], r["seq_len"], r["world_size"]), []).append(r)
    rows = []
    for (flavor, seq, world), runs in sorted(groups.items()):
        measured = max(runs, key=lambda r: r["tps_per_device"])
        predictable = [r for r in runs if r.get("predicted_tps_per_device")]
        predicted = max(predictable, key=lambda r: r["predicted_tps_per_device"]) if predictable else None
        rows.append(
            {
                "flavor": flavor,
                "seq_len": seq,
                "ranks": world,
                "runs": len(runs),
                "measured": measured["label"],
                "measured_family": _family(measured),
                "measured_tps": measured["tps_per_device"],
                "predicted": predicted["label"] if predicted else None,
                "predicted_family": _family(predicted) if predicted else None,
                "agree": None if predicted is None else predicted["label"] == measured["label"],
            }
        )
    return rows


def guide_lines(results: dict[str, Any]) -> list[str]:
    """The report section: measured vs predicted guide, one row per model, sequence length and rank count."""
    rows = guide_rows(results)
    if not rows:
        return []
    lines = [
        "",
        "## Guide: measured vs predicted winner",
        "",
        "Fastest finished run per model and rank count (tokens/s per device) beside the run the planner's prediction "
        "ranks first among the same runs (`meshforge plan --guide` gives the predicted guide at any scale).",
        "",
        "| model | seq | ranks | runs | measured winner | family | tokens/s/dev | predicted winner | family | same |",
        "|---|---:|---:|---:|---|---|---:|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['flavor']} | {r['seq_len']} | {r['ranks']} | {r['runs']} | {r['measured']} | {r['measured_family']} "
            f"| {r['measured_tps']:,.1f} | {r['predicted'] or '-'} | {r['predicted_family'] or '-'} "
            f"| {'-' if r['agree'] is None else 'yes' if r['agree'] else 'no'} |"
        )
    return lines
