"""Run a benchmark matrix: each run its own `meshforge train` job (torchrun), timed after warm-up, one record each.

A run writes into ``OUT/runs/<name>/`` (metrics.jsonl, config.toml, stdout.log, stderr.log, record.json). A finished
run whose command has not changed is skipped when the sweep is run again (``force`` reruns everything,
``retry_failed`` reruns failed ones). A failed run (crash, OOM, timeout, a feature this hardware lacks) is recorded
with its reason and the sweep goes on. ``OUT/results.json`` is rewritten after every run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.bench import ft_rows
from meshforge.bench.machine import cpu_cores, load_average
from meshforge.bench.record import Repetition
from meshforge.bench.spec import BenchMatrix, BenchRun
from meshforge.bench.warm import WarmJob, WarmLauncher
from meshforge.config.io import load_config
from meshforge.errors import ConfigError
from meshforge.model.hf_config import resolve_model_args
from meshforge.parallel.layout import Layout

SCHEMA_VERSION = 2  # 2: repetitions, bootstrap intervals, raw step values, machine state
FINISHED = ("ok", "failed", "unsupported")


@dataclass(frozen=True)
class Launch:
    """How runs are started: one node (torchrun --standalone) or several (torchrun c10d rendezvous)."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 0  # 0: the run's ranks on one node
    rdzv_endpoint: str = ""
    warm: bool = True  # one-node runs start from the warm launcher (bench/warm.py) when it can start

    def nodes_for(self, ranks: int) -> int:
        if self.nnodes == 1 or not self.nproc_per_node or ranks <= self.nproc_per_node:
            return 1
        return ranks // self.nproc_per_node


def command(matrix: BenchMatrix, run: BenchRun, dump_folder: str, launch: Launch) -> list[str]:
    """The command line of one run: what `meshforge train --nproc N` starts (torchrun --standalone; one process
    without torchrun for one rank), or torchrun with a c10d rendezvous across nodes. Calling torchrun directly
    saves a Python start per run; the layout check `--nproc` does first is done by ``layout_refusal``."""
    if run.fault_tolerance:  # a Lighthouse and dp_replicate torchruns (bench/ft_rows.py)
        return ft_rows.command(matrix.train_args(run, dump_folder), run.ranks)
    args = ["-m", "meshforge", "train", *matrix.train_args(run, dump_folder)]
    nodes = launch.nodes_for(run.ranks)
    if nodes == 1 and run.ranks == 1:
        return [sys.executable, *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        return [*torchrun, "--standalone", f"--nproc_per_node={run.ranks}", *args]
    return [
        *torchrun,
        f"--nnodes={nodes}",
        f"--nproc_per_node={launch.nproc_per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={launch.rdzv_endpoint}",
        f"--rdzv_id={matrix.name}-{run.name}",
        *args,
    ]


def layout_refusal(matrix: BenchMatrix, run: BenchRun) -> str:
    """meshforge's own verdict on the layout (degrees vs model shape and sequence length), '' if it is valid."""
    group_ranks = run.ranks // run.dp_replicate if run.fault_tolerance else run.ranks  # the layout of one group
    try:
        cfg = load_config(*matrix.config_and_overrides(run))
        Layout.from_config(cfg, group_ranks).check(resolve_model_args(cfg.model, cfg.training.seq_len))
    except ConfigError as exc:
        return f"meshforge train: config error: {exc}"
    return ""


def threads_per_rank(matrix: BenchMatrix, run: BenchRun) -> int:
    """OMP threads of each rank: the matrix value, or (0) the cores divided among the ranks."""
    if matrix.threads_per_rank > 0:
        return matrix.threads_per_rank
    return max(1, cpu_cores() // run.ranks)


def hardware_refusal(run: BenchRun, launch: Launch) -> str:
    """Why this machine cannot start the run at all ('' if it can): too few local GPUs for a one-node run."""
    import torch

    if run.fault_tolerance and launch.nodes_for(run.ranks) > 1:
        return "fault_tolerance rows start their replica groups on one node (meshforge train --nproc N); run them there"
    if not torch.cuda.is_available() or launch.nodes_for(run.ranks) > 1:
        return ""
    gpus = torch.cuda.device_count()
    if run.ranks > gpus:
        return (
            f"needs {run.ranks} GPUs but this node has {gpus}; run it on more nodes with --nnodes/--nproc-per-node/"
            "--rdzv-endpoint (scripts/slurm_bench.sh)"
        )
    return ""


def run_one(
    matrix: BenchMatrix,
    run: BenchRun,
    out_dir: Path,
    launch: Launch,
    progress: Callable[[int], None] | None = None,
    index: int = 0,
    warm: WarmLauncher | None = None,
) -> Repetition:
    """Start one repetition of a run (in ``runs/<name>/rep<index>/``), from the warm launcher when one is given and
    usable (one node), else as its command line; wait for it (bounded by its timeout), and return what it did
    (bench/record.py combines the repetitions of a run into its record)."""
    folder = out_dir / "runs" / run.name / f"rep{index}"
    folder.mkdir(parents=True, exist_ok=True)
    files = ft_rows.metrics_files(folder, run.dp_replicate) if run.fault_tolerance else [folder / "metrics.jsonl"]
    metrics_path = files[0]  # the progress display follows the first (or only) one
    for path in files if launch.node_rank == 0 else []:
        path.unlink(missing_ok=True)
    cmd = command(matrix, run, str(folder), launch)
    rep: Repetition = {"index": index, "command": cmd, "metrics": [], "wall_s": 0.0, "startup_s": None}
    rep["threads_per_rank"] = threads_per_rank(matrix, run)
    refusal = layout_refusal(matrix, run) or hardware_refusal(run, launch)
    if refusal:
        return rep | {"status": "unsupported", "error": refusal, "load_avg_1m": load_average()}
    suffix = "" if launch.node_rank == 0 else f".node{launch.node_rank}"
    logs = (folder / f"stdout{suffix}.log", folder / f"stderr{suffix}.log")
    one_torchrun = launch.nodes_for(run.ranks) == 1 and not run.fault_tolerance
    warm = warm if warm is not None and warm.usable and one_torchrun else None
    rep["launcher"] = "warm" if warm else "torchrun" if run.ranks > 1 else "python"
    start = time.perf_counter()
    with logs[0].open("w") as out, logs[1].open("w") as err:
        env = run_env(matrix, run, out_dir)
        if warm:
            argv = ["train", *matrix.train_args(run, str(folder))]
            proc: subprocess.Popen[bytes] | WarmJob = warm.start(argv, run.ranks, env, logs[0], logs[1])
        else:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        timed_out = wait(proc, matrix.timeout_of(run), metrics_path, progress)
    wall = time.perf_counter() - start
    metrics = ft_rows.merge([read_metrics(p) for p in files]) if run.fault_tolerance else read_metrics(metrics_path)
    status, error = classify(proc.returncode, timed_out, matrix.timeout_of(run), logs, metrics, matrix.steps)
    return rep | {
        "status": status,
        "error": error,
        "metrics": metrics,
        "wall_s": round(wall, 2),
        "startup_s": startup_s(metrics, wall),
        "load_avg_1m": load_average(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def startup_s(metrics: list[dict[str, Any]], wall_s: float) -> float | None:
    """Wall time outside the steps: process start, imports, set-up (and the shutdown after the last step)."""
    return round(wall_s - metrics[-1]["elapsed_s"], 2) if metrics and wall_s else None


def run_env(matrix: BenchMatrix, run: BenchRun, out_dir: Path) -> dict[str, str]:
    """The environment of a run: OMP threads per rank, unbuffered output, and one inductor cache for the whole sweep
    (kept between runs and sweeps under OUT/cache/, unless the caller chose one): a compile run pays the cold compile
    once, not once per repetition."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(matrix, run)), "PYTHONUNBUFFERED": "1"}
    env.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Manager log every quorum at info
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str((out_dir / "cache" / "inductor").resolve()))
    return env


def wait(
    proc: subprocess.Popen[bytes] | WarmJob, timeout_s: int, metrics_path: Path, progress: Callable[[int], None] | None
) -> bool:
    """Wait for the process group; report logged steps as they appear; kill the group at the timeout (or when the
    bench itself is interrupted)."""
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                stop_group(proc)
                return True
            if progress is not None:
                progress(count_lines(metrics_path))
            time.sleep(0.25)
    except KeyboardInterrupt:  # the job runs in its own session: Ctrl-C reaches only the bench, which ends the job
        stop_group(proc)
        raise
    return False


def stop_group(proc: subprocess.Popen[bytes] | WarmJob) -> None:
    """End the process group this runner started (torchrun and its ranks): TERM, then KILL."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return records


def classify(
    returncode: int | None,
    timed_out: bool,
    timeout_s: int,
    logs: tuple[Path, Path],
    metrics: list[dict[str, Any]],
    steps: int,
) -> tuple[str, str]:
    """(status, error): ok, unsupported (meshforge refused the layout or feature with a reason), or failed."""
    stdout, stderr = (path.read_text(errors="replace") for path in logs)
    if timed_out:
        return "failed", f"timeout: no result within {timeout_s} s ({len(metrics)} of {steps} steps logged)"
    if returncode == 0 and len(metrics) >= steps:
        return "ok", ""
    error = error_line(stderr + "\n" + stdout)
    if returncode == 0:
        return "failed", f"the run ended after {len(metrics)} of {steps} steps"
    if re.search(r"out of memory|OutOfMemoryError|Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9", stderr + stdout):
        return "failed", "OOM: " + (error or "a rank was killed (out of memory?)")
    if re.search(r"meshforge (train|bench)[^\n]*: (config )?error:", stderr + stdout):
        return "unsupported", error
    return "failed", error or f"exit code {returncode}"


_OWN_ERROR = re.compile(r"meshforge [a-z]+:(?: config)? error: .*")
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b(?::.*)?)$")
_NOISE = ("ChildFailedError", "torch.distributed.elastic", "Traceback", "raise ", "During handling")


def error_line(text: str) -> str:
    """The reason a run failed: meshforge's own one-line error, else the first exception line of any rank."""
    own = _OWN_ERROR.findall(text)
    if own:
        return own[0].strip()[:500]
    for raw in text.splitlines():
        line = raw.strip()
        match = _EXCEPTION.match(line)
        if match and not any(noise in line for noise in _NOISE):
            return match.group(1).strip()[:500]
    tail = [line.strip() for line in text.splitlines() if line.strip()]
    return tail[-1][:500] if tail else ""


def record_path(out_dir: Path, name: str) -> Path:
    return out_dir / "runs" / name / "record.json"


def previous_record(out_dir: Path, matrix: BenchMatrix, run: BenchRun) -> dict[str, Any] | None:
    """The saved record of a finished run with the same command, or None (never run, changed, or cut short)."""
    path = record_path(out_dir, run.name)
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("fingerprint") != matrix.fingerprint(run) or record.get("status") not in FINISHED:
        return None
    if record.get("status") == "ok" and len(record.get("repetitions", [])) < matrix.repeat:
        return None  # measured with fewer repetitions than asked for now
    return record


@dataclass
class SweepPlan:
    """What a sweep does, decided once before anything runs: the runs to start, and the earlier records kept."""

    runs: list[BenchRun]
    kept: dict[str, dict[str, Any]]
    todo: list[BenchRun]


def plan_sweep(
    matrix: BenchMatrix,
    out_dir: Path,
    *,
    force: bool = False,
    retry_failed: bool = False,
    only: list[str] | None = None,
) -> SweepPlan:
    """Runs without a finished record (or all with ``force``, or failed ones with ``retry_failed``) are to run; with
    ``only``, just those named are, and every other run keeps its earlier record if it has one."""
    names = [r.name for r in matrix.runs]
    for name in only or []:
        if name not in names:
            raise ConfigError(f"--only {name}: no such run; the matrix has {', '.join(names)}")
    kept: dict[str, dict[str, Any]] = {}
    todo: list[BenchRun] = []
    for run in matrix.runs:
        old = previous_record(out_dir, matrix, run)
        selected = not only or run.name in only
        rerun = force or (retry_failed and old is not None and old["status"] != "ok")
        if selected and (old is None or rerun):
            todo.append(run)
        elif old is not None:
            kept[run.name] = old
    return SweepPlan(list(matrix.runs), kept, todo)


def save_record(out_dir: Path, record: dict[str, Any]) -> None:
    write_json(record_path(out_dir, record["name"]), record)


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def build_results(
    matrix: BenchMatrix, records: list[dict[str, Any]], machine: dict[str, Any], sweep: dict[str, Any]
) -> dict[str, Any]:
    """The content of results.json: the matrix settings, the machine, this sweep, and one record per run."""
    return {
        "schema_version": SCHEMA_VERSION,
        "bench": {
            "name": matrix.name,
            "description": matrix.description,
            "source": matrix.source,
            "flavor": matrix.flavor,
            "dtype": matrix.dtype,
            "seq_len": matrix.seq_len,
            "global_batch_size": matrix.global_batch_size,
            "warmup_steps": matrix.warmup_steps,
            "measured_steps": matrix.measured_steps,
            "baseline": matrix.baseline,
            "parity_rtol": matrix.parity_rtol,
            "repeat": matrix.repeat,
            "confidence": matrix.confidence,
            "note": matrix.note,
            "scaling": matrix.scaling,
        },
        "machine": machine,
        "sweep": sweep,
        "runs": records,
    }


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The run records of a results.json (also accepts a bare list of records)."""
    data = json.loads(Path(path).read_text())
    records = data["runs"] if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ConfigError(f"{path}: expected a results.json written by `meshforge bench`")
    return records
