"""The GPU check: one prepared run (< 8 minutes on one H200) of everything a CPU cannot prove.

    python scripts/gpu_check.py                # on a GPU machine; writes docs/benchmarks/gpu/results.{json,md}
    python scripts/gpu_check.py --dry-run      # anywhere: validates every check's command, writes nothing to docs/

Checks, in priority order (the multi-rank unknowns before Float8 and full AC), each a subprocess with its own time
box, failures recorded and the rest run on; a check left without time by the total budget (--budget-s, 460 s) is
recorded as skipped:

* env: device, driver, torch, CUDA, NCCL, date;
* collectives: several ranks on ONE GPU: NCCL as is (normally "Duplicate GPU detected"), NCCL with
  NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30), gloo with CUDA tensors; every collective checked for its values;
* deterministic: tiny flavor in fp32 with training.deterministic, twice on CUDA (bitwise equal?) and once on CPU
  (losses within 1e-4 relative?);
* train_*: 8B-shaped model (8B_4layers, seq 8192, local batch 2): eager, compile, compile + Float8 (selective AC),
  compile + full AC: tokens/s, MFU (beside TorchTitan's published 39 % for Llama 3 8B + compile on 8 x H100),
  peak memory, final loss;
* async_tp: meshforge's TP + sequence parallel + async TP compiled on 2 ranks (one GPU): are inductor's
  fused_all_gather_matmul / fused_matmul_reduce_scatter in the generated code;
* cp_allgather / cp_ring: context parallel 2 at seq 32768 with each implementation (2 ranks on one GPU, NCCL
  multi-rank mode): tokens/s and peak memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROBES = REPO / "scripts" / "gpu_check_probes.py"
TORCHTITAN_8B_MFU = 39.0
"""TorchTitan's published MFU for Llama 3 8B + torch.compile (bf16, FSDP on 8 x H100; arXiv 2410.06511, table 1)."""
MULTI_RANK_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
"""NCCL >= 2.30's opt-in for several ranks on one GPU (older NCCL refuses: "Duplicate GPU detected")."""


@dataclass
class Check:
    name: str
    argv: list[str]
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)
    parse: str = "none"  # how to read the outcome: none, result_line, metrics
    dump: str = ""  # the run's dump folder (parse = metrics)
    overrides: list[str] = field(default_factory=list)  # meshforge train overrides, validated by --dry-run


@dataclass
class Outcome:
    name: str
    status: str  # ok, failed, timeout, skipped, planned
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    tail: str = ""


def train_check(name: str, out: Path, overrides: list[str], timeout_s: int, nproc: int = 1) -> Check:
    dump = out / name
    full = [*overrides, "--job.dump_folder", str(dump)]
    argv = [sys.executable, "-m", "meshforge", "train", *(["--nproc", str(nproc)] if nproc > 1 else []), *full]
    env = MULTI_RANK_ENV if nproc > 1 else {}
    return Check(name, argv, timeout_s, env=env, parse="metrics", dump=str(dump), overrides=full)


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


EIGHT_B = ["--model.flavor", "8B_4layers", "--training.seq_len", "8192", "--training.local_batch_size", "2"]
EIGHT_B += ["--training.steps", "8", "--metrics.log_freq", "1", "--training.device", "cuda"]
EIGHT_B += ["--training.mixed_precision_param", "bfloat16", "--lr_scheduler.warmup_steps", "2"]
TINY = ["--model.flavor", "tiny", "--training.steps", "5", "--metrics.log_freq", "1", "--training.deterministic"]
TINY += ["--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"]
CP = ["--model.flavor", "8B_4layers", "--training.seq_len", "32768", "--training.local_batch_size", "1"]
CP += ["--training.steps", "5", "--metrics.log_freq", "1", "--training.device", "cuda"]
CP += ["--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"]
CP += ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def plan(out: Path) -> list[Check]:
    """Every check, highest priority first."""
    env = [sys.executable, __file__, "--env-only"]
    sac = ["--activation_checkpoint.mode", "selective"]
    compiled = ["--compile.enable", "true"]
    return [
        Check("env", env, 30, parse="result_line"),
        Check(
            "nccl_2_ranks_1_gpu", torchrun(2, str(PROBES), "collectives", "--backend", "nccl"), 45, parse="result_line"
        ),
        Check(
            "nccl_multi_rank_2_ranks_1_gpu",
            torchrun(2, str(PROBES), "collectives", "--backend", "nccl"),
            45,
            env=MULTI_RANK_ENV,
            parse="result_line",
        ),
        Check(
            "gloo_cuda_2_ranks_1_gpu",
            torchrun(2, str(PROBES), "collectives", "--backend", "gloo"),
            45,
            parse="result_line",
        ),
        train_check("deterministic_cuda_a", out, [*TINY, "--training.device", "cuda"], 40),
        train_check("deterministic_cuda_b", out, [*TINY, "--training.device", "cuda"], 40),
        train_check("deterministic_cpu", out, [*TINY, "--training.device", "cpu"], 60),
        train_check("train_eager", out, [*EIGHT_B, *sac], 90),
        train_check("train_compile", out, [*EIGHT_B, *sac, *compiled], 120),
        Check("async_tp", torchrun(2, str(PROBES), "async_tp"), 120, env=MULTI_RANK_ENV, parse="result_line"),
        train_check("cp_allgather", out, [*CP, "--parallelism.context_parallel_impl", "allgather"], 100, nproc=2),
        train_check("cp_ring", out, [*CP, "--parallelism.context_parallel_impl", "ring"], 100, nproc=2),
        train_check(
            "train_compile_float8", out, [*EIGHT_B, *sac, *compiled, "--quantize.dense.float8.enable", "true"], 120
        ),
        train_check("train_compile_full_ac", out, [*EIGHT_B, "--activation_checkpoint.mode", "full", *compiled], 100),
    ]


def env_info() -> dict[str, Any]:
    """The machine: GPU, driver, torch, CUDA, NCCL, date."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        from meshforge.device.peak import gpu_peak_bf16

        info["peak_bf16_tflops"] = (gpu_peak_bf16(info["device"]) or 0) / 1e12 or None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"]
        info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["driver"] = f"unknown ({type(exc).__name__})"
    return info


def read_metrics(dump: str) -> dict[str, Any]:
    """Median tokens/s and MFU after the first 3 (warm-up, compile) steps, peak memory, losses."""
    path = Path(dump) / "metrics.jsonl"
    if not path.is_file():
        return {"error": f"{path} missing"}
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    steady = records[3:] or records
    mfus = [r["mfu_pct"] for r in steady if r.get("mfu_pct") is not None]
    return {
        "steps": len(records),
        "tps": round(statistics.median(r["tps"] for r in steady), 1),
        "mfu_pct": round(statistics.median(mfus), 2) if mfus else None,
        "peak_memory_gib": round(max(r["peak_memory_gib"] for r in records), 2),
        "losses": [r["loss"] for r in records],
    }


def run_check(check: Check, budget_left: float) -> Outcome:
    timeout = min(check.timeout_s, budget_left)
    if budget_left < 10:
        return Outcome(check.name, "skipped", 0.0, {"why": "the total time budget is spent"})
    start = time.perf_counter()
    env = {**os.environ, **check.env, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    # a session of its own: on a timeout the whole tree (torchrun and its ranks) goes, freeing the GPU
    proc = subprocess.Popen(
        check.argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return Outcome(
            check.name, "timeout", round(time.perf_counter() - start, 1), {"timeout_s": timeout}, text[-1500:]
        )
    details: dict[str, Any] = {"returncode": proc.returncode}
    if check.parse == "result_line":
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if lines:
            details.update(json.loads(lines[-1][len("RESULT ") :]))
    elif check.parse == "metrics" and proc.returncode == 0:
        details.update(read_metrics(check.dump))
    status = "ok" if proc.returncode == 0 else "failed"
    return Outcome(
        check.name, status, round(time.perf_counter() - start, 1), details, "" if status == "ok" else text[-1500:]
    )


def judge(outcomes: dict[str, Outcome]) -> dict[str, Any]:
    """Cross-check findings: determinism, CPU parity, MFU beside TorchTitan's."""
    verdict: dict[str, Any] = {}
    a, b, cpu = (outcomes.get(f"deterministic_{k}") for k in ("cuda_a", "cuda_b", "cpu"))
    if a and b and a.status == b.status == "ok":
        verdict["cuda_bitwise_repeatable"] = a.details["losses"] == b.details["losses"]
    if a and cpu and a.status == cpu.status == "ok":
        diffs = [
            abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a.details["losses"], cpu.details["losses"], strict=False)
        ]
        verdict["cuda_vs_cpu_max_rel_loss_diff"] = max(diffs) if diffs else None
        verdict["cuda_matches_cpu_1e-4"] = bool(diffs) and max(diffs) < 1e-4
    for name in ("train_eager", "train_compile", "train_compile_float8", "train_compile_full_ac"):
        o = outcomes.get(name)
        if o and o.status == "ok" and o.details.get("mfu_pct") is not None:
            verdict[f"{name}_mfu_vs_torchtitan_39"] = round(o.details["mfu_pct"] - TORCHTITAN_8B_MFU, 2)
    return verdict


def write_report(folder: Path, info: dict[str, Any], outcomes: list[Outcome], verdict: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"env": info, "checks": [asdict(o) for o in outcomes], "verdict": verdict}
    (folder / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        "# GPU check results (scripts/gpu_check.py)",
        "",
        f"Device {info.get('device', '?')}, driver {info.get('driver', '?')}, torch {info.get('torch')}, CUDA "
        f"{info.get('cuda')}, NCCL {info.get('nccl', '?')}, {info.get('date')}.",
        "Command: `python scripts/gpu_check.py` (or `bash scripts/gpu_check.sh`).",
        "",
        "| check | status | s | tokens/s | MFU % (TorchTitan 8B: 39) | peak GiB | notes |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        d = o.details
        notes = {k: v for k, v in d.items() if k not in ("tps", "mfu_pct", "peak_memory_gib", "losses", "returncode")}
        note = json.dumps(notes)[:160] if notes else (o.tail.strip().splitlines() or [""])[-1][:160]
        row = f"| {o.name} | {o.status} | {o.seconds} | {d.get('tps', '')} | {d.get('mfu_pct', '')} | "
        lines.append(row + f"{d.get('peak_memory_gib', '')} | {note.replace('|', '/')} |")
    lines += ["", "Verdict: `" + json.dumps(verdict) + "`", ""]
    (folder / "results.md").write_text("\n".join(lines))


def dry_run(checks: list[Check]) -> list[Outcome]:
    """Without a GPU: every meshforge command's overrides load as a config, every probe's arguments parse, the
    environment report runs."""
    sys.path.insert(0, str(PROBES.parent))
    import gpu_check_probes

    from meshforge.config.io import load_config
    from meshforge.tools.dry_run import plan as plan_layout

    outcomes = []
    for check in checks:
        try:
            if check.overrides:  # the config loads and the layout passes every check a real run makes
                cfg = load_config(None, check.overrides)
                report = plan_layout(
                    cfg, int(check.argv[check.argv.index("--nproc") + 1]) if "--nproc" in check.argv else 1
                )
                assert report.target in ("cuda", "cpu")
            elif str(PROBES) in check.argv:
                gpu_check_probes.build_parser().parse_args(check.argv[check.argv.index(str(PROBES)) + 1 :])
            else:
                env_info()
            outcomes.append(Outcome(check.name, "planned", 0.0, {"argv": check.argv, "timeout_s": check.timeout_s}))
        except (Exception, SystemExit) as exc:
            outcomes.append(Outcome(check.name, "failed", 0.0, {"argv": check.argv}, f"{type(exc).__name__}: {exc}"))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="where results go (default docs/benchmarks/gpu; dry run: none)")
    parser.add_argument("--work", default=str(REPO / "outputs" / "gpu_check"), help="the runs' dump folders")
    parser.add_argument("--budget-s", type=float, default=460.0, help="total time for all checks (default 460)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (names as in the plan)")
    parser.add_argument("--dry-run", action="store_true", help="validate every check without a GPU; writes to --out")
    parser.add_argument("--env-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    if args.env_only:
        print("RESULT " + json.dumps(env_info()), flush=True)
        return 0
    checks = [c for c in plan(Path(args.work)) if args.only is None or c.name in args.only]
    if args.dry_run:
        outcomes = dry_run(checks)
        if args.out:
            write_report(Path(args.out), {**env_info(), "mode": "dry run"}, outcomes, {})
        print("\n".join(f"{o.name}: {o.status} {o.tail}" for o in outcomes))
        return 0 if all(o.status == "planned" for o in outcomes) else 1
    return run_all(checks, Path(args.out or REPO / "docs" / "benchmarks" / "gpu"), args.budget_s, progress=print)


def run_all(checks: list[Check], out: Path, budget_s: float, progress: Callable[[str], None]) -> int:
    deadline = time.monotonic() + budget_s
    outcomes: list[Outcome] = []
    for check in checks:
        outcome = run_check(check, deadline - time.monotonic())
        outcomes.append(outcome)
        progress(f"{outcome.name}: {outcome.status} ({outcome.seconds} s) {json.dumps(outcome.details)[:200]}")
    by_name = {o.name: o for o in outcomes}
    info = by_name["env"].details if "env" in by_name else env_info()
    write_report(out, info, outcomes, judge(by_name))
    progress(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
