"""`meshforge plan`: predict a job's memory and throughput at any scale, search layouts, calibrate, check the article.

meshforge plan [--config F] [--section.key value ...] --world-size N --hardware NAME|FILE [--json] [--search]
               [--timeline]
meshforge plan --calibrate DIR/results.json|RUNS.toml --hardware NAME [--out STACK.toml] [--json]
meshforge plan --guide --hardware NAME [--world-sizes 8,64] [--seq-lens 8192] [--models 8B,70B] [--out DIR]
meshforge plan --article [--json]          (every published row: leave-one-out accuracy, sources in docs/planner.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from meshforge.config.io import ConfigError, load_config
from meshforge.plan import report, shipped
from meshforge.plan.accuracy import (
    at_scale,
    calibrate,
    folds,
    loo,
    loo_report,
    production,
    published,
    stack,
    stack_fit,
)
from meshforge.plan.accuracy.fit import FAMILY, Observation
from meshforge.plan.accuracy.interval import interval
from meshforge.plan.accuracy.memory_fit import describe as describe_memory
from meshforge.plan.guide import cli as guide_cli
from meshforge.plan.hardware import HardwareProfile, auto_param_dtype, preset_names
from meshforge.plan.layout import IMPLEMENTATIONS, layout_from_config
from meshforge.plan.physics import fault_tolerance as ft
from meshforge.plan.physics.estimate import estimate, pipeline_timeline
from meshforge.plan.search.advisor import search


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one-line ConfigErrors (the CLI prints them and exits 2)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="meshforge plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="job TOML (the same file `meshforge train` takes)")
    parser.add_argument("--world-size", type=int, help="number of devices to plan for")
    parser.add_argument(
        "--hardware",
        help=f"preset ({', '.join(preset_names())}), stack ({', '.join(shipped.STACKS)}) or a TOML profile",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--search", action="store_true", help="rank every layout that fits and explain the best")
    parser.add_argument(
        "--calibrate",
        metavar="RUNS",
        help="fit a stack profile on --hardware's datasheet to a bench results.json or a TOML of [[run]] tables",
    )
    parser.add_argument("--out", help="with --calibrate: where to write the fitted profile TOML")
    parser.add_argument(
        "--article",
        action="store_true",
        help="leave-one-out predicted vs published for every published row (plan/accuracy/published.py)",
    )
    parser.add_argument(
        "--timeline", action="store_true", help="also show the simulated pipeline step, one line per pipeline rank"
    )
    parser.add_argument(
        "--impl",
        choices=IMPLEMENTATIONS,
        default="meshforge",
        help="whose code runs the job: meshforge (default) or torchtitan (the article's)",
    )
    guide_cli.add_arguments(parser)
    ft.add_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `meshforge plan`; user mistakes raise ConfigError (one line, exit 2)."""
    opts, overrides = build_parser().parse_known_args(argv)
    ft.check_flags(opts)  # a bad --ft-* figure, or one given without --fault-tolerance, before anything runs
    if opts.article:
        return run_article(opts)
    if not opts.hardware:
        raise ConfigError(
            f"--hardware is required: a preset ({', '.join(preset_names())}), a stack ({', '.join(shipped.STACKS)}) "
            "or a TOML profile"
        )
    hw = stack.load_profile(opts.hardware)
    if opts.guide:
        return guide_cli.run_guide(opts, overrides, hw)
    if opts.calibrate:
        return run_calibrate(opts, hw)
    if opts.world_size is None:
        raise ConfigError("--world-size N is required (the number of devices to plan for)")
    cfg = load_config(opts.config, overrides)
    layout = layout_from_config(cfg, opts.world_size, impl=opts.impl, auto_dtype=auto_param_dtype(hw.spec))
    if opts.search:
        result = search(layout, opts.world_size, hw)
        print(json.dumps(report.search_json(result, hw), indent=2) if opts.json else report.format_search(result, hw))
        note = report.stack_note(result.best, hw) if result.ranked and not opts.json else ""
        if note:
            print(note)
        return 0
    est = estimate(layout, hw)
    iv = interval(est, hw)
    trace = pipeline_timeline(layout, hw) if opts.timeline else []
    tolerance = ft.run(opts, cfg, layout, hw) if opts.fault_tolerance else None
    if opts.json:
        out = est.to_dict() | iv.as_dict() | ({"fault_tolerance": tolerance} if tolerance else {})
        out |= {"stack_note": report.stack_note(est, hw)} if hw.stack else {}
        if opts.timeline:
            out["timeline"] = [
                {"rank": rank, "start_s": round(start, 6), "end_s": round(end, 6), "action": action}
                for rank, start, end, action in sorted(trace, key=lambda t: (t[0], t[1]))
            ]
        print(json.dumps(out, indent=2))
        return 0
    print(report.format_estimate(est, hw, iv))
    if tolerance:
        print(ft.format_section(tolerance))
    if opts.timeline:
        print("\n" + report.format_timeline(trace))
    return 0


def run_article(opts: argparse.Namespace) -> int:
    """Every published row (plan/accuracy/published.py): honest leave-one-out and in-sample predictions, per family."""
    v = folds.validation()
    stats = report.fit_statistics(v.fitted.time, v.fitted.memory, v.fitted.start)
    held_out = production.predict_held_out()
    if opts.json:
        out = {
            "summary": loo.summary(v.loo),
            "in_sample_summary": loo.summary(v.in_sample),
            "by_family": loo.by_family(v.loo),
            "in_sample_by_family": loo.by_family(v.in_sample),
            "method": "leave-one-out: every fold refitted from the neutral start (plan/accuracy/loo.py NEUTRAL)",
            "fit": stats,
            "coverage": loo_report.coverage(v),
            "coverage_held_out": loo_report.honest_coverage(v),
            "loso_summary": loo.summary(v.loso),
            "rows": [_article_row(held, ins) for held, ins in zip(v.loo, v.in_sample, strict=True)],
            "held_out": [
                {
                    "key": p.row.key,
                    "setup": p.row.name,
                    "world_size": p.row.world_size,
                    "tflops_per_gpu_published": p.row.tflops_per_gpu,
                    "tflops_per_gpu_predicted": round(p.tflops_per_gpu, 1),
                    "tflops_error": round(p.error, 4),
                    "memory_predicted_gib": round(p.estimate.peak_memory_gib, 2),
                    "fits": p.estimate.fits,
                }
                for p in held_out
            ],
            "cross_stack": [
                {"key": row.key, "setup": row.name, "ac_read_as": mode, "tps_published": row.tps_per_gpu}
                | {
                    "tps_predicted": round(e.tps_per_device, 1),
                    "tps_error": round(e.tps_per_device / row.tps_per_gpu - 1, 4),
                }
                for row, e, mode in production.predict_cross_stack()
            ],
            "at_scale": at_scale.as_json(),
        }
        print(json.dumps(out, indent=2))
        return 0
    print("Every published row, predicted by the constants fitted to all the others (honest leave-one-out):\n")
    print(loo_report.format_validation(v))
    print("\n" + loo_report.format_honest_coverage(v))
    print("\nThe fit to every row (from the neutral start):")
    print(report.format_fit_statistics(stats))
    print("\n" + production.format_held_out(held_out))
    print("\n" + production.format_cross_stack(production.predict_cross_stack()))
    print("\n" + at_scale.format_at_scale())
    return 0


def _article_row(held: loo.Prediction, ins: loo.Prediction) -> dict[str, object]:
    run = published.run(held.key)
    return {
        "key": run.key,
        "source": run.source,
        "setup": run.name,
        "hardware": run.hardware,
        "family": held.family,
        "article_table": run.article_table,
        "tps_published": run.tps,
        "tps_predicted": round(held.estimate.tps_per_device, 1),
        "tps_predicted_in_sample": round(ins.estimate.tps_per_device, 1),
        "tps_error": None if held.tps_error is None else round(held.tps_error, 4),
        "tps_error_in_sample": None if ins.tps_error is None else round(ins.tps_error, 4),
        "memory_published_gib": run.memory_gib,
        "memory_predicted_gib": round(held.estimate.peak_memory_gib, 2),
        "memory_error": None if held.memory_error is None else round(held.memory_error, 4),
        "memory_error_in_sample": None if ins.memory_error is None else round(ins.memory_error, 4),
    }


def run_calibrate(opts: argparse.Namespace, hw: HardwareProfile) -> int:
    """Fit a stack profile to measured runs (a bench results.json or a TOML of [[run]] tables), save it, and report
    what each run determines, what stays at the hardware's, and predicted vs measured before and after."""
    path = Path(opts.calibrate)
    if path.suffix == ".toml":
        obs, sources = stack_fit.read_runs(path, hw)
    else:
        obs, sources = calibrate.read_results(path), {}
        for o in obs:
            calibrate.check_run(o, hw, f"--calibrate {path} run {o.name!r}")
    for line in calibrate.run_warnings(obs, hw):
        print(line, file=sys.stderr)
    out = Path(opts.out) if opts.out else path.parent / f"hardware-{hw.name}-calibrated.toml"
    before = calibrate.compare(obs, hw)
    result = stack_fit.fit_stack(obs, hw, out.stem, sources)
    fitted = result.profile
    after = calibrate.compare(obs, fitted)
    stats = _labelled(report.fit_statistics(result.fit, None, hw), hw) if result.fit is not None else {}
    stack.save(fitted, out)
    spec_names = [k for k in calibrate.TIME_CONSTANTS if not hasattr(fitted.efficiency, k)]
    fitted_spec = {k: getattr(fitted.spec, k) for k in spec_names}
    info = fitted.stack
    assert info is not None
    if opts.json:
        stack_json = {"name": info.name, "fitted": info.fitted, "held": info.held, "world_sizes": info.world_sizes}
        for row in after:
            row["determines"] = result.determines.get(row["name"], ())
        body: dict[str, Any] = {
            "profile": str(out),
            "efficiency": vars(fitted.efficiency),
            "fitted_hardware": fitted_spec,
        }
        body |= {"stack": stack_json, "fit": stats, "runs": after, "runs_before_fit": before}
        print(json.dumps(body, indent=2))
        return 0
    _print_calibration(path, out, hw, obs, result, stats, before, after)
    return 0


def _cell(text: str) -> str:
    """Text inside a markdown table cell: a '|' would split the row."""
    return text.replace("|", "\\|")


def _labelled(stats: dict[str, Any], hw: HardwareProfile) -> dict[str, Any]:
    """The fit's statistics with the compute factor named as the rest of --calibrate's output names it (fit.py's
    family factor of the preset, e.g. family:h100, is 'compute')."""
    family = FAMILY + hw.spec.name
    for c in stats["constants"]:
        c["name"] = stack_fit.COMPUTE if c["name"] == family else c["name"]
    for d in stats["dropped"]:
        d["name"] = stack_fit.COMPUTE if d["name"] == family else d["name"]
    return stats


def _print_calibration(
    path: Path,
    out: Path,
    hw: HardwareProfile,
    obs: list[Observation],
    result: stack_fit.StackFit,
    stats: dict[str, Any],
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
) -> None:
    """--calibrate's text output: the fit, its statistics, predicted vs measured per run, the memory fit."""
    fitted = result.profile
    assert fitted.stack is not None
    base = f"{hw.stack.name}'s constants on {hw.name}'s datasheet" if hw.stack else f"{hw.name}'s datasheet"
    print(f"calibrated stack {fitted.stack.name!r} on {base} from {len(obs)} runs of {path}; written to {out}")
    print(report.format_stack_fit(result, hw))
    if stats:
        print(report.format_fit_statistics(_escaped(stats)))
    print("\n| run | layout | determines | TPS measured | predicted before | after | error |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row, old in zip(after, before, strict=True):
        what = ", ".join(result.determines.get(row["name"], ())) or "-"
        emulated = " (emulated Float8: not fitted)" if row["emulated"] else ""
        layout = row["layout"].replace(" | ", "; ")
        print(
            f"| {_cell(row['name'])} | {layout} | {what} | {row['tps_measured']:,.1f} | {old['tps_predicted']:,.1f} | "
            f"{row['tps_predicted']:,.1f} | {row['tps_error']:+.1%}{emulated} |"
        )
    mem_rows = [r for r in after if "memory_error" in r]
    print(describe_memory(result.memory, hw, fitted, obs), end="")
    for row in mem_rows:
        print(
            f"memory {row['name']}: {row['memory_measured_gib']:.2f} GiB measured, {row['memory_predicted_gib']:.2f} "
            f"predicted ({row['memory_error']:+.1%})"
        )
    fitted_rows = [r for r in after if not r["emulated"]]
    within = sum(abs(r["tps_error"]) <= 0.25 for r in fitted_rows)
    mem_within = sum(abs(r["memory_error"]) <= 0.25 for r in mem_rows)
    print(
        f"\nwithin 25 %: throughput {within} of {len(fitted_rows)} fitted runs, memory {mem_within} of {len(mem_rows)}"
    )


def _escaped(stats: dict[str, Any]) -> dict[str, Any]:
    """The statistics with the run names in 'determined by' safe inside a markdown cell."""
    constants = [c | {"determined_by": [_cell(n) for n in c["determined_by"]]} for c in stats["constants"]]
    return stats | {"constants": constants}
