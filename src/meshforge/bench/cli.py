"""`meshforge bench [--config configs/bench/X.toml] [--out DIR]`: run a matrix of parallel strategies, each as its own
torchrun job, and write DIR/results.json, DIR/report.md and PNG plots. Without --config: the built-in CPU default."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshforge.bench import schedule
from meshforge.bench.auto_rows import resolve_auto_rows
from meshforge.bench.machine import LoadSampler, machine_info, speed_probe, speed_summary
from meshforge.bench.matrix import load_matrix
from meshforge.bench.record import Repetition, make_record
from meshforge.bench.runner import (
    Launch,
    SweepPlan,
    build_results,
    command,
    layout_refusal,
    plan_sweep,
    run_env,
    run_one,
    save_record,
    write_json,
)
from meshforge.bench.spec import BenchMatrix, BenchRun
from meshforge.bench.warm import WarmLauncher
from meshforge.config.io import ConfigError, load_config, read_data

DEFAULT_MATRIX = "configs/bench/default.toml"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshforge bench", description=__doc__)
    parser.add_argument("--config", default=None, help=f"a matrix TOML (default: {DEFAULT_MATRIX})")
    parser.add_argument("--out", default=None, help="output folder (default: outputs/bench/<matrix name>)")
    parser.add_argument(
        "--repeat", type=int, default=0, help="repetitions of every run, interleaved (default: the matrix's, 3)"
    )
    parser.add_argument("--list", action="store_true", help="print the matrix and the commands it would run; run none")
    parser.add_argument("--only", default="", help="comma list of run names to run (the others are left out)")
    parser.add_argument("--force", action="store_true", help="rerun finished runs too")
    parser.add_argument("--retry-failed", action="store_true", help="rerun failed and unsupported runs")
    parser.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from results.json")
    parser.add_argument(
        "--hardware",
        default="",
        help="planner profile calibrated for the predicted column (default: cpu on a CPU, none on GPUs; 'none' skips)",
    )
    parser.add_argument("--compare-with", choices=["reference"], default="", help="add the article's figures")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a run failed or missed loss parity")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes taking part (multi-node: one driver per node)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index (0 writes the results)")
    parser.add_argument("--nproc-per-node", type=int, default=0, help="ranks per node for multi-node runs")
    parser.add_argument("--rdzv-endpoint", default="", help="host:port of the torchrun c10d rendezvous")
    parser.add_argument(
        "--launcher",
        choices=["warm", "torchrun"],
        default="warm",
        help="one-node runs: forked from one process that imported torch once (warm, the default; the same ranks and "
        "environment as torchrun, see bench/warm.py) or each started by torchrun",
    )
    return parser.parse_args(argv)


def default_matrix_path() -> str:
    """configs/bench/default.toml of this checkout (or of the working directory)."""
    here = Path(__file__).resolve().parents[3] / DEFAULT_MATRIX
    return str(here) if here.is_file() else DEFAULT_MATRIX


def make_launch(args: argparse.Namespace) -> Launch:
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: need nnodes >= 1, 0 <= rank < nnodes")
    if args.nnodes > 1 and (args.nproc_per_node < 1 or not args.rdzv_endpoint):
        raise ConfigError(
            "--nnodes > 1 needs --nproc-per-node N and --rdzv-endpoint HOST:PORT (scripts/slurm_bench.sh)"
        )
    return Launch(args.nnodes, args.node_rank, args.nproc_per_node, args.rdzv_endpoint, args.launcher == "warm")


def main(argv: list[str]) -> int:
    if argv[:1] == ["compare"]:
        from meshforge.bench.compare import main as compare_main

        return compare_main(argv[1:])
    args = parse(argv)
    matrix = load_matrix(args.config or default_matrix_path())  # ConfigError on a bad matrix
    if args.repeat < 0:
        raise ConfigError(f"--repeat {args.repeat}: use a positive number of repetitions (default {matrix.repeat})")
    matrix = dataclasses.replace(matrix, repeat=args.repeat or matrix.repeat)
    out = Path(args.out or f"outputs/bench/{matrix.name}")
    launch = make_launch(args)
    if launch.nnodes > 1:  # every node's driver must start the same jobs: a fixed count, no data-driven stopping
        matrix = dataclasses.replace(matrix, max_repeat=0)
    matrix, picks = resolve_auto_rows(matrix, args.hardware) if not args.report_only else (matrix, {})
    for name, pick in picks.items():
        print(f"meshforge bench: run {name!r} is auto:\n{pick['why']}", flush=True)
    check_train_args(matrix)
    only = [n for n in args.only.split(",") if n]
    if args.list:
        print_matrix(matrix, out, launch, args.compare_with)
        return 0
    if args.report_only:
        results = read_data(out / "results.json", "--report-only", fmt="json", hint="; run the sweep first")
    else:
        plan = plan_sweep(matrix, out, force=args.force, retry_failed=args.retry_failed, only=only)
        results = sweep(matrix, plan, out, launch)
        for record in results["runs"]:  # an auto row's pick, runner-up and why (bench/auto_rows.py)
            record.update({"auto": picks[record["name"]]} if record["name"] in picks else {})
    if launch.node_rank != 0:
        return 0
    finish(matrix, results, out, args.compare_with, planner_hardware(args.hardware, results))
    return exit_code(results, args.strict)


def check_train_args(matrix: BenchMatrix) -> None:
    """Every run's `meshforge train` keys parse and validate: a typo in the matrix fails before anything runs."""
    for run in matrix.runs:
        try:
            load_config(*matrix.config_and_overrides(run))
        except ConfigError as exc:
            raise ConfigError(f"run {run.name!r} of {matrix.source}: {exc}") from None


def exit_code(results: dict[str, Any], strict: bool) -> int:
    records = results["runs"]
    if not any(r["status"] == "ok" for r in records):
        return 1
    if strict and any(r["status"] != "ok" or not (r.get("parity") or {}).get("ok", False) for r in records):
        return 1
    return 0


def planner_hardware(choice: str, results: dict[str, Any]) -> str:
    """The planner profile the leave-one-out predictions calibrate ('' for none)."""
    if choice == "none":
        return ""
    return choice or ("cpu" if results["machine"]["device"] == "cpu" else "")


def finish(matrix: BenchMatrix, results: dict[str, Any], out: Path, compare_with: str, hardware: str = "cpu") -> None:
    """Parity, ratios with intervals, the planner's predictions, results.json, report.md and the plots."""
    from meshforge.bench.analysis import attach_ratios
    from meshforge.bench.plots import write_plots
    from meshforge.bench.report import attach_parity, write_report

    attach_parity(results, {r.name: matrix.rtol_of(r) for r in matrix.runs})
    attach_ratios(results)
    if hardware and sum(r["status"] == "ok" for r in results["runs"]) > 2:
        predict(results, hardware, out)
    write_json(out / "results.json", results)
    report = write_report(results, out, compare_with=compare_with)
    plots = write_plots(results, out)
    print(f"meshforge bench: wrote {out / 'results.json'}, {report} and {', '.join(p.name for p in plots)}")


def predict(results: dict[str, Any], hardware: str, out: Path) -> None:
    """The planner's leave-one-out predictions beside the runs. The measurements stand without them: a planner that
    fails says so in one line (and in results.json's ``prediction.error``) instead of losing the sweep's report."""
    from meshforge.bench.predict import attach_predictions

    try:
        attach_predictions(results, hardware, cache=out / "cache" / "prediction.json")
    except Exception as exc:  # any planner failure: the report is written without the column
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        results["prediction"] = {"error": line}
        print(
            f"meshforge bench: the planner's predictions failed ({line}); the report has no Predicted column",
            file=sys.stderr,
        )


def sweep(matrix: BenchMatrix, plan: SweepPlan, out: Path, launch: Launch) -> dict[str, Any]:
    """Run what the plan says must run (keeping the rest), repetitions interleaved across runs (ABC ABC ABC, so a
    slow minute of the machine falls on every run, not on one), with a live progress display; results.json after
    every repetition. A run refused or failed in its first repetition is not repeated."""
    machine = machine_info()
    records = dict(plan.kept)
    todo = [run for run in plan.todo if launch.node_rank < launch.nodes_for(run.ranks)]
    reps: dict[str, list[Repetition]] = {run.name: [] for run in todo}
    start = time.perf_counter()
    warm = start_warm(matrix, out, launch, todo)
    with LoadSampler() as load, SweepDisplay(matrix, plan) as display, closing(warm):

        def results() -> dict[str, Any]:
            info = {
                "ran": len(todo),
                "reused": len(plan.kept),
                "repeat": matrix.repeat,
                "order": "interleaved",
                "stopping": schedule.rule(matrix),
                "launcher": launcher_info(warm),
                "wall_s": round(time.perf_counter() - start, 1),
                "load_avg_1m": load.summary(),
                "machine_speed": speed_summary(speeds),
            }
            return build_results(matrix, [records[r.name] for r in plan.runs if r.name in records], machine, info)

        speeds: list[float] = []
        while batch := schedule.next_round(matrix, todo, reps, records):  # bench/schedule.py: the stopping rule
            speeds.append(speed_probe())
            started = 0
            for run in batch:
                if not schedule.fits(matrix, run, reps[run.name], time.perf_counter() - start):
                    continue  # past its minimum and over the time budget
                index, started = len(reps[run.name]), started + 1
                display.start(run, index)
                rep = run_one(matrix, run, out, launch, progress=display.step, index=index, warm=warm)
                reps[run.name].append(rep)
                records[run.name] = make_record(matrix, run, reps[run.name])
                if launch.node_rank == 0:
                    save_record(out, records[run.name])
                    write_json(out / "results.json", results())
                display.done(run, reps[run.name][-1], index)
            if not started:
                break
        speeds.append(speed_probe())
        return results()


def start_warm(matrix: BenchMatrix, out: Path, launch: Launch, todo: list[BenchRun]) -> WarmLauncher | None:
    """The warm launcher for this sweep's one-node runs (None when not asked for, not needed, or unable to start).
    Not needed: no run would start from it (fault-tolerant rows start their own groups; a layout the model refuses
    starts nothing), e.g. ``--force --only`` a refused run."""
    if not launch.warm or launch.nnodes > 1 or all(run.fault_tolerance or layout_refusal(matrix, run) for run in todo):
        return None
    env = run_env(matrix, todo[0], out) | {"OMP_NUM_THREADS": "1"}
    warm = WarmLauncher(env)
    if not warm.usable:
        print(f"meshforge bench: the warm launcher could not start ({warm.ready}); using torchrun", file=sys.stderr)
        return None
    return warm


@contextlib.contextmanager
def closing(warm: WarmLauncher | None) -> Iterator[None]:
    """End the warm process when the sweep ends, however it ends."""
    try:
        yield
    finally:
        if warm is not None:
            warm.close()


def launcher_info(warm: WarmLauncher | None) -> dict[str, Any]:
    if warm is None:
        return {"kind": "torchrun"}
    return {"kind": "warm", "import_s": warm.ready.get("import_s"), "usable_to_the_end": warm.usable}


def rule_text(matrix: BenchMatrix) -> str:
    """', up to 8 until +-5%': the sequential rule, '' when every run has a fixed count."""
    if matrix.max_repeat <= matrix.repeat:
        return ""
    return f", up to {matrix.max_repeat} until +-{matrix.target_half_width:.0%}"


def print_matrix(matrix: BenchMatrix, out: Path, launch: Launch, compare_with: str) -> None:
    """--list: the runs, their layouts and batches, and the exact commands, without running anything."""
    from meshforge.bench.reference import figure

    print(f"matrix {matrix.name} ({matrix.source}): {matrix.description}")
    print(
        f"model {matrix.flavor}, {matrix.dtype}, seq {matrix.seq_len}, global batch {matrix.global_batch_size}, "
        f"{matrix.warmup_steps} warm-up + {matrix.measured_steps} measured steps, {matrix.repeat} repetitions "
        f"(interleaved{rule_text(matrix)}), baseline {matrix.baseline or '-'}; ranked at {matrix.ranked_ranks} ranks"
        + (f" ({matrix.cores} cores: runs on more ranks are oversubscribed)" if matrix.cores else "")
    )
    header = f"{'run':<24} {'ranks':>5}  {'layout':<42} {'seq':>6} {'batch':>9}  {'timeout':>7}"
    if compare_with == "reference":
        header += f"  {'article TPS/GPU':>15} {'GiB':>5}  article row"
    print(header)
    for run in matrix.runs:
        batch = f"{matrix.local_batch_size(run)}x{run.gradient_accumulation_steps}"
        line = (
            f"{run.name:<24} {run.ranks:>5}  {run.describe():<42} {matrix.seq_len_of(run):>6} {batch:>9}  "
            f"{matrix.timeout_of(run):>6}s"
        )
        if compare_with == "reference" and run.reference:
            fig = figure(run.reference)
            line += (
                f"  {fig.tps_per_gpu:>15,.0f} {fig.memory_gib:>5.1f}  {fig.table.split(':')[0]}: {fig.configuration}"
            )
        print(line + ("  (oversubscribed: not ranked)" if matrix.oversubscribed(run) else ""))
    for name, runs in matrix.scaling.items():
        print(f"scaling series {name}: {', '.join(runs)}")
    print("\ncommands (batch = local batch x gradient accumulation):")
    for run in matrix.runs:
        print(shlex.join(command(matrix, run, str(out / "runs" / run.name), launch)))


class SweepDisplay:
    """Live progress (rich): what runs now, at which step, what is left; one line per finished run."""

    def __init__(self, matrix: BenchMatrix, plan: SweepPlan):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.matrix, self.plan, self.todo = matrix, plan, plan.todo
        self.console = Console(highlight=False)
        if not self.console.is_terminal:  # logs and CI: long lines, no wrapping
            self.console = Console(highlight=False, width=200)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.minimum = {run.name: schedule.minimum_repeat(matrix, run) for run in self.todo}
        self.runs = self.progress.add_task("runs", total=sum(self.minimum.values()))
        self.steps = self.progress.add_task("  steps", total=matrix.steps)

    def __enter__(self) -> SweepDisplay:
        kept = self.plan.kept
        self.console.print(
            f"meshforge bench {self.matrix.name}: {len(self.todo)} runs to go, {len(kept)} reused "
            f"(finished earlier; --force reruns them); {self.matrix.repeat} repetitions each, interleaved"
            + (
                f", then more until each interval is within +-{self.matrix.target_half_width:.0%} (at most "
                f"{self.matrix.max_repeat}, {self.matrix.time_budget_s:.0f} s budget)"
                if self.matrix.max_repeat > self.matrix.repeat
                else ""
            )
        )
        for name, old in kept.items():
            self.console.print(f"  = {name:<22} {old['status']:<11} {self.summary(old)}")
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, run: BenchRun, index: int = 0) -> None:
        left = [r.name for r in self.todo[self.todo.index(run) + 1 :]]
        more = f"  (then: {', '.join(left[:4])}{', ...' if len(left) > 4 else ''})" if left else ""
        rep = f" [{self.count(run, index)}]"
        if index >= self.minimum[run.name]:  # a repetition past the minimum (the interval is still too wide)
            self.progress.update(self.runs, total=(self.progress.tasks[self.runs].total or 0) + 1)
        self.progress.update(self.runs, description=f"{run.name}{rep} on {run.ranks} ranks{more}")
        self.progress.reset(self.steps, total=self.matrix.steps)

    def step(self, logged: int) -> None:
        self.progress.update(self.steps, completed=logged)

    def done(self, run: BenchRun, rep: Repetition, index: int = 0) -> None:
        mark = {"ok": "ok", "unsupported": "--", "failed": "XX"}[rep["status"]]
        line = f"  {mark} {run.name:<22} {rep['status']:<11} {self.rep_summary(rep)}"
        self.console.print(line + (f"  [{self.count(run, index)}]" if self.matrix.repeat > 1 else ""))
        self.progress.advance(self.runs)

    def count(self, run: BenchRun, index: int) -> str:
        """'2/3': repetition 2 of a minimum of 3; '4/3+': a repetition past the minimum."""
        least = self.minimum[run.name]
        return f"{index + 1}/{least}" + ("+" if index >= least else "")

    def rep_summary(self, rep: Repetition) -> str:
        if rep["status"] != "ok":
            return rep["error"][:160]
        steps = [m for m in rep["metrics"] if m["step"] > self.matrix.warmup_steps]
        tps = sorted(m["tps"] for m in steps)[len(steps) // 2] if steps else 0.0
        memory = max((m["peak_memory_gib"] for m in steps), default=0.0)
        return (
            f"{tps:9.1f} tok/s/device  {memory:.3f} GiB  loss {rep['metrics'][-1]['loss']:.4f}  "
            f"{rep['wall_s']:.1f} s (start-up {rep['startup_s'] or 0:.1f} s)"
        )

    @staticmethod
    def summary(record: dict[str, Any]) -> str:
        if record["status"] != "ok":
            return record["error"][:160]
        return (
            f"{record['tps_per_device']:9.1f} tok/s/device  {record['peak_memory_gib']:.3f} GiB  "
            f"loss {record['final_loss']:.4f}  {record['wall_s']:.1f} s"
        )
