"""The honest leave-one-out of plan/accuracy/loo.py as Markdown: every row beside its in-sample error, then per family.

Kept out of loo.py (on the prediction path, hashed by plan/accuracy/folds.py's key) so that its wording can change
without refitting the folds.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from meshforge.plan.accuracy import fit, interval, loo, published
from meshforge.plan.accuracy.folds import Validation
from meshforge.plan.accuracy.loo import Prediction, by_family, observations, summary
from meshforge.plan.hardware import load_hardware


def row_interval(pred: Prediction, v: Validation) -> interval.Interval:
    """The row's interval from its fold's constants, with its family's shipped spreads (hardware.py)."""
    obs = next(o for o in observations() if o.name == pred.key)
    profile = v.folds[pred.key].profile_for(obs)
    shipped = load_hardware(pred.family).efficiency
    eff = replace(profile.efficiency, tps_log_sd=shipped.tps_log_sd, memory_log_sd=shipped.memory_log_sd)
    return interval.interval(pred.estimate, replace(profile, efficiency=eff))


def format_validation(v: Validation) -> str:
    """Honest leave-one-out (the accuracy) beside in-sample errors of every published row, then per family."""
    runs = {r.key: r for r in published.RUNS}
    lines = [
        "| row | source | hardware | TPS/GPU published | LOO predicted | LOO error | in-sample error | "
        "memory GiB published | LOO predicted | LOO error | in-sample error | LOO memory verdict |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for held, ins in zip(v.loo, v.in_sample, strict=True):
        run, e = runs[held.key], held.estimate
        iv = row_interval(held, v)
        mem = (
            f"{run.memory_gib:.1f} | {e.peak_memory_gib:.1f} | {held.memory_error:+.1%} | {ins.memory_error:+.1%}"
            if held.memory_error is not None and ins.memory_error is not None
            else f"- | {e.peak_memory_gib:.1f} | - | -"
        )
        lines.append(
            f"| {run.name} | {run.source} | {run.hardware} | {run.tps:,.0f} | {e.tps_per_device:,.0f} | "
            f"{held.tps_error or 0:+.1%} | {ins.tps_error or 0:+.1%} | {mem} | {iv.verdict} "
            f"({iv.memory_low:.0f}-{iv.memory_high:.0f} of {iv.usable_gib:.0f}) |"
        )
    s, i = summary(v.loo), summary(v.in_sample)
    lines.append(
        f"\nhonest leave-one-out (each fold refitted from the neutral start) median |error|: TPS {s['tps_median']:.1%} "
        f"({s['tps_rows']} rows), memory {s['memory_median']:.1%} ({s['memory_rows']} rows); max {s['tps_max']:.1%} / "
        f"{s['memory_max']:.1%}. In-sample (not an accuracy): {i['tps_median']:.1%} / {i['memory_median']:.1%}."
    )
    lines += ["", *format_families(v)]
    return "\n".join(lines)


def format_families(v: Validation) -> list[str]:
    """Per hardware family: rows, honest LOO median / max, in-sample median, of tokens/s and memory, and how many
    rows the shipped interval holds (tokens/s: leave-one-source-out predictions; memory: the LOO rows themselves)."""
    lines = [
        "| family | TPS rows | LOO median | LOO max | in-sample median | LOSO inside shipped +-1 sd | memory rows | "
        "LOO median | LOO max | in-sample median | inside +-1 sd (by construction) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ins, cover = by_family(v.in_sample), coverage(v)
    for name, s in by_family(v.loo).items():
        i = ins[name]
        c = cover[name]
        mem = (
            f"{s['memory_rows']} | {s['memory_median']:.1%} | {s['memory_max']:.1%} | {i['memory_median']:.1%} | "
            f"{c['memory_inside']:.0%}"
            if s["memory_rows"]
            else "0 | - | - | - | -"
        )
        lines.append(
            f"| {name} | {s['tps_rows']} | {s['tps_median']:.1%} | {s['tps_max']:.1%} | {i['tps_median']:.1%} | "
            f"{c['tps_inside']:.0%} | {mem} |"
        )
    lines.append(
        "(LOSO inside shipped +-1 sd: the share of the family's rows, each predicted by the fit without its source, "
        "within the family's shipped tokens/s spread; memory: the LOO rows within the memory spread, which is their "
        "own 68.3 % quantile, so 68 % by construction for a family of 5 rows or more; nominal 68 %)"
    )
    return lines


COVERAGE_Z = 1.0
"""The intervals are +-1 standard deviation: nominal coverage 68.3 %."""


def coverage(v: Validation) -> dict[str, dict[str, float]]:
    """Per family: the share of rows inside the family's shipped +-1 sd, and the rows counted: tokens/s on the
    leave-one-source-out errors (spread only, the constants' covariance left out; a row from a source the fit did not
    see, as a user's own stack is), memory on the leave-one-out errors (the rows that set that spread)."""
    out: dict[str, dict[str, float]] = {}
    for name in by_family(v.loo):
        eff = load_hardware(name).efficiency
        tps = [math.log1p(e) for p in v.loso if p.family == name and (e := p.tps_error) is not None]
        mem = [math.log1p(e) for p in v.loo if p.family == name and (e := p.memory_error) is not None]
        out[name] = {
            "tps_rows": len(tps),
            "tps_inside": sum(abs(x) <= COVERAGE_Z * eff.tps_log_sd for x in tps) / len(tps) if tps else 0.0,
            "memory_rows": len(mem),
            "memory_inside": sum(abs(x) <= COVERAGE_Z * eff.memory_log_sd for x in mem) / len(mem) if mem else 0.0,
        }
    return out


MIN_FAMILY_ROWS = 5
"""A family with fewer rows than this gets at least the pooled spread (two rows cannot measure their own)."""
NOMINAL = 0.6827
"""The share of a normal distribution within +-1 sd: a spread is this quantile of |log error|, so that the interval
holds that share of the rows (an RMS would be inflated by the heavy tail: 83 % of the reference rows inside)."""


def spread(preds: list[Prediction], kind: str) -> tuple[int, float]:
    """(rows, the NOMINAL quantile of |log error|) of the predictions' tokens/s (kind "tps") or memory."""
    errors = [abs(math.log1p(e)) for p in preds if (e := getattr(p, f"{kind}_error")) is not None]
    return len(errors), float(np.quantile(errors, NOMINAL)) if errors else 0.0


def shipped_values(v: Validation) -> dict[str, object]:
    """What plan/shipped.py must hold for this validation: the reference constants (the fit to all rows), per family
    its factor and spreads (the NOMINAL quantile of its rows' honest leave-one-out errors, at least the pooled one
    below MIN_FAMILY_ROWS), the unseen generation's spreads (the reference's with the family prior added), the
    covariance and the paired spread."""
    start, scale = v.fitted.start, v.fitted.time.scale
    ref: dict[str, float] = {n: fit.value(start, n) * scale.get(n, 1.0) for n in loo.TIME_NAMES}
    mem = v.fitted.memory
    ref |= {"allocator_overhead": mem.allocator_overhead, "framework_gib": mem.framework_gib}
    rows = {name: [p for p in v.loo if p.family == name] for name in by_family(v.loo)}
    source = spread(v.loso, "tps")[1]
    for kind in ("tps", "memory"):
        ref[f"{kind}_log_sd"] = spread(rows[loo.REFERENCE], kind)[1]
    ref["tps_log_sd"] = max(ref["tps_log_sd"], source)
    families = {}
    for name, preds in rows.items():
        if name == loo.REFERENCE:
            continue
        families[name] = {"factor": scale.get(fit.FAMILY + name, 1.0)}
        for kind in ("tps", "memory"):
            n, own = spread(preds, kind)
            families[name][f"{kind}_log_sd"] = max(own, spread(v.loo, kind)[1]) if n < MIN_FAMILY_ROWS else own
        families[name]["tps_log_sd"] = max(families[name]["tps_log_sd"], source)
    prior = loo.FAMILY_PRIOR_SD
    unseen = {k: math.hypot(ref[k], prior) for k in ("tps_log_sd", "memory_log_sd")}
    return {
        "REFERENCE": ref,
        "FAMILIES": families,
        "UNSEEN": unseen,
        "COVARIANCE_NAMES": tuple(v.fitted.time.names),
        "COVARIANCE": v.fitted.time.covariance.tolist(),
        "DIFF_LOG_SD": difference_spread(v),
        "SOURCE_LOG_SD": source,
        "SOURCE_COVERAGE": source_coverage(v)["inside"],
    }


def source_rows(v: Validation) -> list[tuple[str, float]]:
    """(source, log error) of every row's leave-one-source-out tokens/s prediction."""
    runs = {r.key: r for r in published.RUNS}
    return [(runs[p.key].source, math.log1p(e)) for p in v.loso if (e := p.tps_error) is not None]


def source_coverage(v: Validation) -> dict[str, float]:
    """The shipped new-source spread's coverage, nested: each source's leave-one-source-out errors against the
    NOMINAL quantile of the other sources' (at_scale.held_out_coverage): what a source the spread never saw meets."""
    from meshforge.plan.accuracy.at_scale import held_out_coverage

    return held_out_coverage(source_rows(v))


def shipped_on_sources(v: Validation) -> dict[str, float]:
    """How many leave-one-source-out predictions lie inside the interval each row's family ships (spread only):
    the coverage of the printed interval on rows from a source the fit did not see."""
    xs = [(math.log1p(e), p.family) for p in v.loso if (e := p.tps_error) is not None]
    inside = sum(abs(x) <= COVERAGE_Z * load_hardware(f).efficiency.tps_log_sd for x, f in xs)
    return {"rows": len(xs), "inside": inside / len(xs) if xs else 0.0, "count": inside}


def format_shipped(values: dict[str, object]) -> str:
    """plan/shipped.py's assignments for ``values`` (rounded), to paste after a refit."""

    def r(x: object) -> object:
        if isinstance(x, float):
            return round(x, 4)
        if isinstance(x, dict):
            return {k: r(y) for k, y in x.items()}
        if isinstance(x, list | tuple):
            return tuple(r(y) for y in x)
        return x

    return "\n".join(f"{k} = {r(val)!r}" for k, val in values.items())


def difference_spread(v: Validation) -> float:
    """The NOMINAL quantile, over pairs of rows of one source and one family, of the |difference| of their honest
    log errors: how far a predicted ratio of two layouts misses (what a source's rows share cancels)."""
    runs = {r.key: r for r in published.RUNS}
    logs = [(runs[p.key].source, p.family, math.log1p(p.tps_error)) for p in v.loo if p.tps_error is not None]
    diffs = [abs(a[2] - b[2]) for i, a in enumerate(logs) for b in logs[i + 1 :] if a[:2] == b[:2]]
    return float(np.quantile(diffs, NOMINAL)) if diffs else 0.0


def honest_coverage(v: Validation) -> dict[str, dict[str, float]]:
    """Coverage measured on rows that did not set the spread, for the leave-one-out and the leave-one-source-out
    predictions: each source's rows against the +-1 sd spread (NOMINAL quantile of |log error|) of the other
    sources' rows (at_scale.held_out_coverage), with each kind's median |error|. ``coverage`` above counts rows
    against spreads they set themselves (68 % by construction); this one does not."""
    from meshforge.plan.accuracy.at_scale import held_out_coverage

    runs = {r.key: r for r in published.RUNS}
    out: dict[str, dict[str, float]] = {}
    for kind, preds in (("loo", v.loo), ("loso", v.loso)):
        rows = [(runs[p.key].source, math.log1p(e)) for p in preds if (e := p.tps_error) is not None]
        out[kind] = held_out_coverage(rows) | {
            "tps_median": float(np.median([abs(math.expm1(x)) for _, x in rows])) if rows else 0.0
        }
    out["shipped_on_loso"] = shipped_on_sources(v)
    return out


def format_honest_coverage(v: Validation) -> str:
    """LOO beside leave-one-source-out: median |error| and coverage on rows that did not set the spread."""
    c = honest_coverage(v)
    lines = [
        "Leave-one-out beside leave-one-source-out (every row of a source left out together: near twins cannot "
        "flatter it), tokens/s; coverage of +-1 sd counted on rows that did not set it (each source against the "
        "other sources' spread; nominal 68 %):",
    ]
    for kind, label in (("loo", "leave-one-out"), ("loso", "leave-one-source-out")):
        k = c[kind]
        lines.append(
            f"- {label}: median |error| {k['tps_median']:.1%}, coverage {k['inside']:.0%} of {k['rows']:.0f} rows "
            f"({k['sources']:.0f} sources)"
        )
    k, sd = c["shipped_on_loso"], spread(v.loso, "tps")[1]
    lines.append(
        f"- the interval `meshforge plan --hardware <GPU preset>` prints (each family's shipped tokens/s spread, "
        f"plan/shipped.py) on the leave-one-source-out predictions: {k['count']:.0f} of {k['rows']:.0f} inside "
        f"({k['inside']:.0%}). The new-source spread (their 68.3 % quantile, shipped.SOURCE_LOG_SD) is {sd:.3f}: "
        f"counted on the rows that set it, 68 % by construction; measured on a source that did not (nested, "
        f"above) {c['loso']['inside']:.0%}"
    )
    return "\n".join(lines)
