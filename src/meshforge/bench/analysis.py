"""The statistical part of the report: ratios to the baseline with intervals, the ranking, the noise of the sweep,
the machine's state and the planner's leave-one-out predictions (report.py places these sections)."""

from __future__ import annotations

from typing import Any

from meshforge.bench import stats
from meshforge.bench.machine import noise_warnings

Record = dict[str, Any]


def _ok(results: dict[str, Any]) -> list[Record]:
    return [r for r in results["runs"] if r["status"] == "ok" and r.get("tps_steps")]


def confidence_of(results: dict[str, Any]) -> float:
    return float(results["bench"].get("confidence") or stats.CONFIDENCE)


def attach_ratios(results: dict[str, Any]) -> None:
    """Each ok record gains ``ratio_to_baseline`` [median ratio, low, high] and ``separable_from_baseline``."""
    name = results["bench"].get("baseline")
    base = next((r for r in _ok(results) if r["name"] == name), None)
    for record in results["runs"]:
        record["ratio_to_baseline"], record["separable_from_baseline"] = None, None
        if base is None or record["status"] != "ok" or not record.get("tps_steps"):
            continue
        ratio = stats.ratio_ci(record["tps_steps"], base["tps_steps"], confidence_of(results))
        record["ratio_to_baseline"] = [ratio.median, ratio.low, ratio.high]
        record["separable_from_baseline"] = record is not base and ratio.excludes(1.0)


def ci_cell(record: Record) -> str:
    ci = record.get("tps_per_device_ci")
    return "-" if not ci else f"{ci[0]:,.1f}-{ci[1]:,.1f}"


def ratio_cell(record: Record) -> str:
    """'1.23x (1.10-1.31) *': the ratio to the baseline, its interval, and a star when it excludes 1."""
    ratio = record.get("ratio_to_baseline")
    if not ratio:
        return "-"
    star = " *" if record.get("separable_from_baseline") else ""
    return f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f}){star}"


def prediction_cells(record: Record) -> tuple[str, str]:
    """(predicted tokens/s per device, its error) for the strategies table."""
    value, error = record.get("predicted_tps_per_device"), record.get("prediction_error")
    if value is None:
        return "-", "-"
    note = " (emulated Float8: not scored)" if record.get("flags", {}).get("float8_emulate") else ""
    return f"{value:,.1f}", f"{error:+.0%}{note}"


def ranked_pool(results: dict[str, Any]) -> list[Record]:
    """The runs ranked on speed: strategies at the baseline's world size and sequence length, each rank with a core
    of its own (a run with more ranks than cores is not ranked: bench/ranks.py)."""
    pool = [r for r in _ok(results) if r["group"] == "strategy" and not r.get("oversubscribed")]
    base = next((r for r in pool if r["name"] == results["bench"].get("baseline")), None)
    if base is not None:
        pool = [r for r in pool if (r["world_size"], r["seq_len"]) == (base["world_size"], base["seq_len"])]
    return pool


def ranking_lines(results: dict[str, Any]) -> list[str]:
    """Strategies at the baseline's world size and sequence length, fastest first; '>' where the ratio's interval
    excludes 1 (separable at the chosen confidence), '~' where these data cannot tell the two apart."""
    pool = ranked_pool(results)
    if len(pool) < 2:
        return []
    level = confidence_of(results)
    places = stats.ranking({r["name"]: r["tps_steps"] for r in pool}, level)
    chain = ""
    for place in places:
        chain += f"`{place.name}`"
        if place.separable_from_next is not None:
            chain += " > " if place.separable_from_next else " ~ "
    separable = sum(bool(p.separable_from_next) for p in places)
    return [
        f"\n## Ranking (tokens/s per device, {len(pool)} strategies at {pool[0]['world_size']} ranks)\n",
        chain,
        "",
        f"`>`: the next one down is slower beyond noise (the {level:.0%} interval of the ratio of their "
        f"medians excludes 1); `~`: these data cannot tell the two apart. {separable} of {len(places) - 1} "
        "neighbouring pairs are separable. Runs with more ranks than cores are not ranked.",
    ]


def runner_up_note(results: dict[str, Any], fastest: Record, pool: list[Record]) -> str:
    """'; ahead of X beyond noise' or '; not separable from X' (the second fastest), '' without step values."""
    others = [r for r in pool if r is not fastest and r.get("tps_steps")]
    if not others or not fastest.get("tps_steps"):
        return ""
    second = max(others, key=lambda r: r["tps_per_device"])
    level = confidence_of(results)
    ratio = stats.ratio_ci(fastest["tps_steps"], second["tps_steps"], level)
    if ratio.excludes(1.0):
        return f"; ahead of the runner-up `{second['name']}` beyond noise ({ratio.low:.2f}-{ratio.high:.2f}x)"
    return f"; **not separable** from `{second['name']}` at {level:.0%} ({ratio.low:.2f}-{ratio.high:.2f}x)"


def statistics_table(results: dict[str, Any]) -> list[str]:
    """Per run: repetitions, measured steps, the median and its interval, each repetition's median, outlier steps."""
    level = confidence_of(results)
    lines = [
        "\n## Statistics per run\n",
        f"Medians over the steady-state steps of all repetitions; {level:.0%} interval: Student's t over the "
        "repetitions' log medians (one repetition: a bootstrap over its steps); repetitions went on past the "
        "minimum while an interval was wider than the target (bench/schedule.py); outliers are steps beyond 1.5 IQR "
        "of the run's steps (kept in the median, listed as repetition:step = tokens/s).\n",
        "| Run | Repetitions | Steps | Median | Interval | +- % | Per repetition | Outlier steps |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results["runs"]:
        if r["status"] != "ok" or r.get("tps_per_device_ci") is None:
            continue
        per_rep = ", ".join("-" if x.get("tps_per_device") is None else f"{x['tps_per_device']:,.0f}"
                            for x in r.get("repetitions", []))  # fmt: skip
        outs = ", ".join(f"{rep}:{step} = {value:,.0f}" for rep, step, value in r.get("outlier_steps", [])) or "-"
        half = r.get("tps_per_device_ci_half_width") or 0.0
        lines.append(
            f"| `{r['name']}` | {len(r.get('repetitions', []))} | {r['measured_steps']} | "
            f"{r['tps_per_device']:,.1f} | {ci_cell(r)} | {100 * half:.1f} | {per_rep} | {outs} |"
        )
    return lines + steps_advice(results)


def steps_advice(results: dict[str, Any]) -> list[str]:
    """Is another measured step cheaper than another start? The ranked runs' pooled noise and costs, and the
    cost-optimal number of measured steps per start-up (stats.optimal_steps) beside the matrix's."""
    pool = [r for r in ranked_pool(results) if len(r.get("tps_steps") or []) >= 2 and r.get("step_time_s")]
    steps = int(results["bench"].get("measured_steps") or 1)
    parts = [p for p in (stats.variance_parts(r["tps_steps"], steps) for r in pool) if p is not None]
    starts = [r["wall_s"] - steps * r["step_time_s"] for r in pool if r.get("wall_s")]
    if not parts or not starts:
        return []
    within = sum(p[0] for p in parts) / len(parts)
    between = sum(p[1] for p in parts) / len(parts)
    start, step = sorted(starts)[len(starts) // 2], sorted(r["step_time_s"] for r in pool)[len(pool) // 2]
    best = stats.optimal_steps(start, step, within, between)
    return [
        f"\nSteps per start-up: on this sweep's ranked runs a repetition costs {start:.1f} s before its measured "
        f"steps (start-up, warm-up) and {step:.2f} s per step; a step varies by {within**0.5:.1%} within its "
        f"process, a process by {between**0.5:.1%}. The narrowest interval per second measures **{best}** steps "
        f"per start-up (this matrix: {steps}; `measured_steps` in the matrix file).",
    ]


def noise_lines(results: dict[str, Any]) -> list[str]:
    """A warning block at the top of the report when the sweep was noisy; nothing when it was not."""
    warnings = noise_warnings(results["machine"], results.get("sweep", {}), results["runs"])
    if not warnings:
        return []
    return ["> **Noisy sweep: read the figures with care.**", *[f"> - {w}" for w in warnings], ""]


def machine_lines(results: dict[str, Any]) -> list[str]:
    """The machine's state: clocks where readable, load before and during the sweep, the order of the runs."""
    machine, sweep = results["machine"], results.get("sweep", {})
    mhz = machine.get("cpu_mhz") or []
    freq = machine.get("cpufreq") or {}
    clock = f"{min(mhz):,.0f}-{max(mhz):,.0f} MHz (/proc/cpuinfo)" if mhz else "not reported by /proc/cpuinfo"
    if freq:
        clock += ", cpufreq " + ", ".join(f"{k} {v}" for k, v in freq.items())
    during = sweep.get("load_avg_1m") or {}
    load = f"{during['min']:.2f} / {during['median']:.2f} / {during['max']:.2f}" if during.get("samples") else "-"
    repeat = sweep.get("repeat", results["bench"].get("repeat", 1))
    speed = sweep.get("machine_speed") or {}
    probes = (
        f" Machine speed ({speed.get('probe', 'fp32 matmul')}, before each repetition round and after the last): "
        f"{', '.join(f'{v:.1f}' for v in speed['gflops'])} GFLOP/s (spread {speed['spread']:.1%})."
        if speed.get("gflops")
        else ""
    )
    return [
        f"- Machine state: clock {clock}; 1-minute load average before the sweep "
        f"{machine.get('load_avg_1m_before') or 0:.2f}{busy_text(machine)}, during it (min / median / max of "
        f"{during.get('samples', 0)} samples) {load}.{probes}",
        f"- Every run repeated {repeat} times, each repetition its own job, {sweep.get('order', 'in order')} across "
        "runs (run A, B, C, then A, B, C again), so a slow minute of the machine falls on every run."
        + stopping_text(sweep.get("stopping") or {}),
    ]


def stopping_text(rule: dict[str, Any]) -> str:
    """The sequential rule of the sweep, one sentence ('' when every run had a fixed count)."""
    if not rule.get("target_half_width"):
        return ""
    budget = f" while the sweep stayed within {rule['time_budget_s']:.0f} s" if rule.get("time_budget_s") else ""
    return (
        f" Then, one round at a time, a run whose interval was wider than +-{rule['target_half_width']:.0%} was "
        f"repeated again (up to {rule['maximum']}){budget}; runs with more ranks than cores "
        f"({rule['cores']}) ran {rule['oversubscribed_repeat']} time(s)."
    )


def busy_text(machine: dict[str, Any]) -> str:
    busy = machine.get("busy_cores_before")
    return "" if busy is None else f" (cores busy with other work just before it: {busy:.2f})"


def prediction_lines(results: dict[str, Any]) -> list[str]:
    """The planner's leave-one-out accuracy on this machine, one paragraph."""
    loo = results.get("prediction")
    if loo and loo.get("error"):
        return [f"\n**Planner beside the measurements**: the leave-one-out fits failed ({loo['error']})."]
    if not loo or loo.get("median_abs_error") is None:
        return []
    return [
        f"\n**Planner beside the measurements**: `Predicted` is `meshforge plan`'s tokens/s per device with the "
        f"`{loo['hardware']}` profile calibrated on this sweep's other runs (leave-one-out: the run itself was not "
        f"fitted). Median absolute error over {loo['runs_scored']} runs: **{loo['median_abs_error']:.0%}**. Plot: "
        "`prediction.png`.",
    ]
