"""`meshforge bench [--config configs/bench/X.toml] [--out DIR]`: run a matrix of parallel strategies, each as its own
torchrun job, and write DIR/results.json, DIR/report.md and PNG plots. Without --config: the built-in CPU default."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

from meshforge.bench.matrix import BenchMatrix, BenchRun, load_matrix
from meshforge.bench.runner import (
    Launch,
    SweepPlan,
    build_results,
    command,
    machine_info,
    plan_sweep,
    run_one,
    save_record,
    write_json,
)
from meshforge.config.io import ConfigError

DEFAULT_MATRIX = "configs/bench/default.toml"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshforge bench", description=__doc__)
    parser.add_argument("--config", default=None, help=f"a matrix TOML (default: {DEFAULT_MATRIX})")
    parser.add_argument("--out", default=None, help="output folder (default: outputs/bench/<matrix name>)")
    parser.add_argument("--list", action="store_true", help="print the matrix and the commands it would run; run none")
    parser.add_argument("--only", default="", help="comma list of run names to run (the others are left out)")
    parser.add_argument("--force", action="store_true", help="rerun finished runs too")
    parser.add_argument("--retry-failed", action="store_true", help="rerun failed and unsupported runs")
    parser.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from results.json")
    parser.add_argument("--compare-with", choices=["reference"], default="", help="add the article's figures")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a run failed or missed loss parity")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes taking part (multi-node: one driver per node)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index (0 writes the results)")
    parser.add_argument("--nproc-per-node", type=int, default=0, help="ranks per node for multi-node runs")
    parser.add_argument("--rdzv-endpoint", default="", help="host:port of the torchrun c10d rendezvous")
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
    return Launch(args.nnodes, args.node_rank, args.nproc_per_node, args.rdzv_endpoint)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        matrix = load_matrix(args.config or default_matrix_path())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out = Path(args.out or f"outputs/bench/{matrix.name}")
    launch = make_launch(args)
    check_train_args(matrix)
    only = [n for n in args.only.split(",") if n]
    if args.list:
        print_matrix(matrix, out, launch, args.compare_with)
        return 0
    if args.report_only:
        path = out / "results.json"
        if not path.is_file():
            raise ConfigError(f"--report-only: {path} does not exist; run the sweep first")
        results = json.loads(path.read_text())
    else:
        try:
            plan = plan_sweep(matrix, out, force=args.force, retry_failed=args.retry_failed, only=only)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        results = sweep(matrix, plan, out, launch)
    if launch.node_rank != 0:
        return 0
    finish(matrix, results, out, args.compare_with)
    return exit_code(results, args.strict)


def check_train_args(matrix: BenchMatrix) -> None:
    """Every run's `meshforge train` keys parse and validate: a typo in the matrix fails before anything runs."""
    from meshforge.config.io import load_config

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


def finish(matrix: BenchMatrix, results: dict[str, Any], out: Path, compare_with: str) -> None:
    """Parity, results.json, report.md and the plots; prints where they are."""
    from meshforge.bench.plots import write_plots
    from meshforge.bench.report import attach_parity, write_report

    attach_parity(results, {r.name: matrix.rtol_of(r) for r in matrix.runs})
    write_json(out / "results.json", results)
    report = write_report(results, out, compare_with=compare_with)
    plots = write_plots(results, out)
    print(f"meshforge bench: wrote {out / 'results.json'}, {report} and {', '.join(p.name for p in plots)}")


def sweep(matrix: BenchMatrix, plan: SweepPlan, out: Path, launch: Launch) -> dict[str, Any]:
    """Run what the plan says must run (keeping the rest), with a live progress display; results.json after each."""
    machine = machine_info()
    records = dict(plan.kept)
    todo = [run for run in plan.todo if launch.node_rank < launch.nodes_for(run.ranks)]
    start = time.perf_counter()

    def results() -> dict[str, Any]:
        info = {"ran": len(todo), "reused": len(plan.kept), "wall_s": round(time.perf_counter() - start, 1)}
        return build_results(matrix, [records[r.name] for r in plan.runs if r.name in records], machine, info)

    with SweepDisplay(matrix, plan) as display:
        for run in todo:
            display.start(run)
            record = run_one(matrix, run, out, launch, progress=display.step)
            records[run.name] = record
            if launch.node_rank == 0:
                save_record(out, record)
                write_json(out / "results.json", results())
            display.done(run, record)
    return results()


def print_matrix(matrix: BenchMatrix, out: Path, launch: Launch, compare_with: str) -> None:
    """--list: the runs, their layouts and batches, and the exact commands, without running anything."""
    from meshforge.bench.reference import figure

    print(f"matrix {matrix.name} ({matrix.source}): {matrix.description}")
    print(
        f"model {matrix.flavor}, {matrix.dtype}, seq {matrix.seq_len}, global batch {matrix.global_batch_size}, "
        f"{matrix.warmup_steps} warm-up + {matrix.measured_steps} measured steps, baseline {matrix.baseline or '-'}"
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
        print(line)
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
        self.runs = self.progress.add_task("runs", total=len(self.todo))
        self.steps = self.progress.add_task("  steps", total=matrix.steps)

    def __enter__(self) -> SweepDisplay:
        kept = self.plan.kept
        self.console.print(
            f"meshforge bench {self.matrix.name}: {len(self.todo)} runs to go, {len(kept)} reused "
            f"(finished earlier; --force reruns them)"
        )
        for name, old in kept.items():
            self.console.print(f"  = {name:<22} {old['status']:<11} {self.summary(old)}")
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, run: BenchRun) -> None:
        left = [r.name for r in self.todo[self.todo.index(run) + 1 :]]
        more = f"  (then: {', '.join(left[:4])}{', ...' if len(left) > 4 else ''})" if left else ""
        self.progress.update(self.runs, description=f"{run.name} on {run.ranks} ranks{more}")
        self.progress.reset(self.steps, total=self.matrix.steps)

    def step(self, logged: int) -> None:
        self.progress.update(self.steps, completed=logged)

    def done(self, run: BenchRun, record: dict[str, Any]) -> None:
        mark = {"ok": "ok", "unsupported": "--", "failed": "XX"}[record["status"]]
        self.console.print(f"  {mark} {run.name:<22} {record['status']:<11} {self.summary(record)}")
        self.progress.advance(self.runs)

    @staticmethod
    def summary(record: dict[str, Any]) -> str:
        if record["status"] != "ok":
            return record["error"][:160]
        return (
            f"{record['tps_per_device']:9.1f} tok/s/device  {record['peak_memory_gib']:.3f} GiB  "
            f"loss {record['final_loss']:.4f}  {record['wall_s']:.1f} s"
        )
