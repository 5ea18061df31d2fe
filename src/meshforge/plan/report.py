"""Text and JSON renderings of estimates and search results (what `meshforge plan` prints)."""

from __future__ import annotations

from typing import Any

from meshforge.plan.advisor import SearchResult, best_by, complexity
from meshforge.plan.estimate import Estimate
from meshforge.plan.hardware import HardwareProfile

TIME_LABELS = {
    "compute": "compute (matmuls, attention, element-wise)",
    "exposed_fsdp_comm": "exposed FSDP all-gather / reduce-scatter",
    "exposed_tp_comm": "exposed TP all-gather / reduce-scatter",
    "exposed_cp_comm": "exposed CP K/V exchange",
    "exposed_pp_comm": "exposed PP send / receive",
    "pipeline_bubble": "pipeline bubble",
    "optimizer": "optimizer step",
}
SHORT = {
    "compute": "compute",
    "exposed_fsdp_comm": "FSDP comm",
    "exposed_tp_comm": "TP comm",
    "exposed_cp_comm": "CP comm",
    "exposed_pp_comm": "PP comm",
    "pipeline_bubble": "bubble",
    "optimizer": "optimizer",
}


def format_estimate(est: Estimate, hw: HardwareProfile) -> str:
    """The human-readable prediction for one layout."""
    lay = est.layout
    lines = [
        f"meshforge plan: {lay.flavor} on {lay.world_size} x {hw.name} ({hw.spec.description})",
        f"layout: {lay.describe()}",
        "",
        f"peak memory per device (GiB), pipeline rank {est.memory.rank}:",
    ]
    for key, value in est.memory.as_dict().items():
        lines.append(f"  {key.replace('_', ' '):<28} {value:8.2f}")
    usable = est.capacity_gib - est.runtime_gib
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"  {'peak':<28} {est.peak_memory_gib:8.2f}   of {usable:.1f} usable -> {verdict}")
    lines += ["", f"step time (s), {est.layout.tokens_per_device_step:,.0f} tokens per device per step:"]
    for key, value in est.time.items():
        lines.append(f"  {TIME_LABELS[key]:<44} {value:9.4f}  {value / est.step_time:6.1%}")
    lines.append(f"  {'total':<44} {est.step_time:9.4f}")
    lines += ["", f"tokens/s per device: {est.tps_per_device:,.1f}    MFU: {est.mfu_pct:.1f} %"]
    lines += [f"warning: {w}" for w in est.warnings]
    return "\n".join(lines)


def format_timeline(trace: list[tuple[int, float, float, str]], width: int = 100) -> str:
    """The simulated pipeline step as one line per rank: F forward, B backward, I / W the input- and weight-gradient
    halves of a split backward, '.' waiting (bubble or sends); each column is 1/width of the step."""
    if not trace:
        return "timeline: no pipeline parallel in this layout"
    makespan = max(end for _, _, end, _ in trace)
    ranks = 1 + max(rank for rank, _, _, _ in trace)
    rows = [["."] * width for _ in range(ranks)]
    for rank, start, end, action in sorted(trace, key=lambda t: t[1]):
        kind = action.strip("0123456789")
        first = min(width - 1, int(start / makespan * width))
        last = max(first + 1, round(end / makespan * width))
        rows[rank][first:last] = [kind] * (last - first)
        del rows[rank][width:]
    lines = [f"pipeline step, simulated ({makespan * 1e3:.1f} ms; one column = {makespan / width * 1e3:.2f} ms):"]
    lines += [f"  rank {rank:>3} |{''.join(row)}|" for rank, row in enumerate(rows)]
    return "\n".join(lines)


def _row(label: str, est: Estimate) -> str:
    parts = sorted(est.time.items(), key=lambda kv: -kv[1])[1:3]
    overhead = ", ".join(f"{SHORT[k]} {v / est.step_time:.0%}" for k, v in parts if v > 0)
    return (
        f"| {label} | {est.layout.describe()} | {est.tps_per_device:,.1f} | {est.mfu_pct:.1f} | "
        f"{est.peak_memory_gib:.1f} | {'yes' if est.fits else 'no'} | {overhead} |"
    )


def why(winner: Estimate, other: Estimate) -> str:
    """How ``other`` differs from ``winner``: speed, and the step-time parts (per token) that grew or shrank most."""
    if other is winner:
        return "the recommendation"
    rel = other.tps_per_device / winner.tps_per_device - 1
    w_tok, o_tok = winner.layout.tokens_per_device_step, other.layout.tokens_per_device_step
    floor = 0.01 * winner.step_time / w_tok  # ignore parts that move by less than 1 % of the winner's time per token
    deltas = {k: d for k in winner.time if abs(d := other.time[k] / o_tok - winner.time[k] / w_tok) >= floor}
    costs = ", ".join(
        f"{SHORT[k]} +{d * 1e3:.3g}" for d, k in sorted(((d, k) for k, d in deltas.items()), reverse=True)[:2] if d > 0
    )
    saves = ", ".join(f"{SHORT[k]} {d * 1e3:.3g}" for d, k in sorted((d, k) for k, d in deltas.items())[:2] if d < 0)
    text = f"{rel:+.1%}"
    if costs:
        text += f"; costs {costs} ms/token"
    if saves:
        text += f"; saves {saves} ms/token"
    if rel > 0:
        text += (
            f"; not chosen: {complexity(other.layout)} parallel dimensions beyond FSDP vs {complexity(winner.layout)}"
        )
        if not other.fits:
            text += ", does not fit"
    elif not other.fits:
        text += "; does not fit"
    return text


def format_search(result: SearchResult, hw: HardwareProfile) -> str:
    """The recommendation, the runner-up and the config's own layout, then why this TP degree and this schedule."""
    best = result.best
    lay = best.layout
    header = (
        "| | layout | tokens/s/device | MFU % | memory GiB | fits | largest overheads |\n"
        "|---|---|---:|---:|---:|---|---|"
    )
    lines = [
        f"meshforge plan --search: {lay.flavor} on {lay.world_size} x {hw.name}, global batch "
        f"{lay.local_batch_size * lay.dp} x seq {lay.seq_len}; {result.tried} layouts tried, "
        f"{len(result.ranked)} fit",
        "",
        header,
        _row("recommended", best),
    ]
    if len(result.ranked) > 1:
        lines.append(_row("runner-up", result.ranked[1]))
    if result.baseline is not None:
        lines.append(_row("your config", result.baseline))
    lines += ["", "why this TP degree (best fitting layout per TP degree):"]
    lines += [f"  TP {e.layout.tp}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})" for e in _sorted(result, "tp")]
    lines += ["", "why this pipeline schedule (best fitting layout per schedule):"]
    for e in _sorted(result, "schedule"):
        name = e.layout.schedule if e.layout.pp > 1 else "no pipeline"
        lines.append(f"  {name}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})")
    lines += ["", "why this AC mode (best fitting layout per mode):"]
    lines += [
        f"  {e.layout.ac_mode}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})" for e in _sorted(result, "ac_mode")
    ]
    return "\n".join(lines)


def _sorted(result: SearchResult, key: str) -> list[Estimate]:
    return sorted(best_by(result, key), key=lambda e: -e.tps_per_device)


def search_json(result: SearchResult) -> dict[str, Any]:
    """The JSON form of a search: the recommendation (top-level keys as for one estimate) and the alternatives."""
    out = result.best.to_dict()
    out["runner_up"] = result.ranked[1].to_dict() if len(result.ranked) > 1 else None
    out["config_layout"] = result.baseline.to_dict() if result.baseline else None
    out["layouts_tried"], out["layouts_fitting"] = result.tried, len(result.ranked)
    out["best_per_tp"] = [_brief(e) for e in _sorted(result, "tp")]
    out["best_per_schedule"] = [_brief(e) for e in _sorted(result, "schedule")]
    return out


def _brief(est: Estimate) -> dict[str, Any]:
    return {
        "layout": est.layout.describe(),
        "tps_per_device": round(est.tps_per_device, 2),
        "peak_memory_gib": round(est.peak_memory_gib, 2),
    }
