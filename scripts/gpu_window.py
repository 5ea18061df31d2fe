"""The second GPU window (issue 46): ONE prepared run on one GPU (H100 80 GB or H200; python3 3.12, torch
2.11.0+cu130, no network, torchao from gpu_wheels/), built on scripts/gpu_check.py's machinery (its Check, time-boxed
subprocesses that kill their whole tree, parsers, exit codes). On the device, from the repository root:

    PYTHON=python3 bash scripts/gpu_window.sh --out $OUT/window2   # results.json / results.md after every check
    PYTHON=python3 bash scripts/gpu_window.sh --dry-run            # anywhere: the plan, its boxes, every set-up

The checks, in order of value (boxes: scripts/gpu_window_budgets.py; those that do not fit in 480 s are dropped, last
first, and named): env; the sharded kernels on one GPU through ``meshforge train --local-ranks 2`` (TP 2, CP 2, FSDP
2, EP 2) against one process (scripts/local_ranks_check.py's runs); memory of Llama 3.2 1B at AC none / selective /
full (last step's max_memory_allocated / reserved vs the exact step and the planner: gpu_window_memory.py); Float8
tensorwise and rowwise vs bf16 (the first runs of configs/bench/gpu-1.toml); the peer, TorchTitan (not carried:
``NOT_HERE``); the rest of the bench matrix (report and plots in OUT/bench); then, if room is left, the 3B's memory
and activation offload. ``--device cpu`` runs the same plan on a CPU (the rehearsal: tests/unit/test_gpu_window.py).

Exit status as gpu_check.py: 0 all planned checks ran and passed; 1 one did not pass; 3 all that ran passed, some did
not run (dropped from the budget, unsupported here, a module absent).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check as gc  # noqa: E402  (sibling scripts)
import gpu_window_judge as judge  # noqa: E402
import local_ranks_check as lrc  # noqa: E402
from gpu_window_budgets import BUDGETS, MEASURED, TOTAL_S  # noqa: E402
from gpu_window_memory import EXPECTED  # noqa: E402

BENCH = "configs/bench/gpu-1.toml"
FIRST_BENCH_RUNS = ("compile", *judge.FLOAT8_RUNS)
LOCAL = {"lr_dense_ref": "dense_ref", "lr_tp2": "local_tp2", "lr_cp2": "local_cp2", "lr_fsdp2": "local_fsdp2"}
LOCAL |= {"lr_moe_ref": "moe_ref", "lr_ep2": "local_ep2"}
NOT_HERE = {
    "peer_torchtitan": (
        "TorchTitan not carried: torchtitan 0.2.2 (the release before 0.3.0, which runs here with torch 2.14) is a "
        "450 kB wheel, but its llama3 trainer imports datasets (HF) at start-up, which needs pyarrow (42.4 MB for "
        "cp312 x86_64) on top of tokenizers (3.4 MB), tyro, torchdata and tensorboard: more than gpu_wheels/' "
        "20 MiB, and the device has no network (docs/benchmarks/gpu/README.md, the second window)"
    ),
    "regather_auto": (
        "not on one GPU: gradient_sync.regather decides whether FSDP re-gathers its parameter shards between "
        "microsteps; one rank holds no shards, and local ranks have no device memory of their own to decide on"
    ),
}
"""Planned checks that cannot run on this device, and why (status ``unsupported``: the run exits 3, not 0)."""


def mem_flags(flavor: str, ac: str, device: str, extra: tuple[str, ...] = ()) -> list[str]:
    flags = ["--training.device", device, "--model.flavor", flavor, "--training.seq_len", "8192"]
    flags += ["--training.local_batch_size", "1", "--training.mixed_precision_param", "bfloat16"]
    flags += ["--activation_checkpoint.mode", ac, "--training.steps", "4", "--metrics.log_freq", "1"]
    return [*flags, "--lr_scheduler.warmup_steps", "2", *extra]


def mem_check(name: str, flags: list[str], work: Path) -> gc.Check:
    dump = str(work / name)
    argv = [sys.executable, str(REPO / "scripts" / "gpu_window_memory.py"), "measure", *flags]
    argv += ["--job.dump_folder", dump]
    return gc.Check(name, argv, BUDGETS[name], parse="result_line", dump=dump, overrides=flags)


def local_check(name: str, device: str, work: Path) -> gc.Check:
    dump = work / name
    argv = lrc.argv_of(LOCAL[name], device, dump)
    box = BUDGETS[name] if device == "cuda" else lrc.BOX_S[LOCAL[name]]  # the rehearsal: 1.5 x the CPU's time
    return gc.Check(name, argv, box, parse="metrics", dump=str(dump), overrides=argv[4:])


def bench_check(name: str, out: Path, only: tuple[str, ...]) -> gc.Check:
    argv = [sys.executable, "-m", "meshforge", "bench", "--config", BENCH, "--out", str(out / "bench")]
    return gc.Check(name, [*argv, *(["--only", ",".join(only)] if only else [])], BUDGETS[name])


def plan(work: Path, out: Path = Path("OUT"), device: str = "cuda") -> list[gc.Check]:
    """Every check, highest value first (module docstring)."""
    checks = [gc.Check("env", [sys.executable, gc.__file__, "--env-only"], BUDGETS["env"], parse="result_line")]
    checks += [local_check(name, device, work) for name in LOCAL]
    checks += [mem_check(f"mem_1b_{ac}", mem_flags("1B", ac, device), work) for ac in ("selective", "none", "full")]
    checks += [bench_check("float8_1b", out, FIRST_BENCH_RUNS)]
    checks[-1].needs = "torchao"
    checks += [gc.Check("peer_torchtitan", [], 0), bench_check("bench_gpu1", out, ())]
    checks += [mem_check(f"mem_3b_{ac}", mem_flags("3B", ac, device), work) for ac in ("selective", "full")]
    offload = mem_flags("1B", "selective", device, ("--activation_checkpoint.offload", "true"))
    return [*checks, mem_check("offload_1b", offload, work), gc.Check("regather_auto", [], 0)]


def set_up(check: gc.Check, device: str) -> None:
    """One check's set-up without running it (the dry run): configs load, layouts pass every check a real run makes,
    the bench matrix parses for this device, every memory check has its expectation for the same flags."""
    from meshforge.config.io import load_config
    from meshforge.tools.dry_run import plan as plan_layout

    if check.name in LOCAL:
        with contextlib.redirect_stdout(io.StringIO()):  # its own plan lines: the window prints its own
            lrc.dry_run([LOCAL[check.name]], device, float("inf"))
    elif check.name.startswith(("mem_", "offload_")):
        assert plan_layout(load_config(None, check.overrides), 1).target == device
        held = json.loads(EXPECTED.read_text()).get(check.name, {}) if EXPECTED.is_file() else {}
        assert check.name.startswith("offload_") or held.get("flags") == check.overrides, (
            f"{EXPECTED.name} has no expectation for {check.name}'s flags: python scripts/gpu_window_memory.py expect"
        )
    elif check.name.startswith(("bench_", "float8_")):
        import tomllib

        from meshforge.bench.matrix import parse_matrix

        matrix = parse_matrix(tomllib.loads((REPO / BENCH).read_text()), BENCH, device=device)
        names = [r.name for r in matrix.runs]
        assert set(FIRST_BENCH_RUNS) <= set(names), f"{BENCH} lacks one of {FIRST_BENCH_RUNS}"
        for run in matrix.runs:
            path, overrides = matrix.config_and_overrides(run)
            assert plan_layout(load_config(path, [*overrides, "--training.device", device]), run.ranks).target == device
    elif check.name == "env":
        gc.env_info()


def outcome_of(check: gc.Check, device: str, dry: bool, budget_left: float) -> gc.Outcome:
    if check.name in NOT_HERE:
        return gc.Outcome(check.name, "unsupported", 0.0, {"why": NOT_HERE[check.name]})
    if missing := gc.module_missing(check.needs):
        return gc.Outcome(check.name, "skipped", 0.0, {"why": missing})
    if not dry:
        return gc.run_check(check, budget_left)
    try:
        set_up(check, device)
    except (Exception, SystemExit) as exc:
        return gc.Outcome(check.name, "failed", 0.0, {"argv": check.argv}, f"{type(exc).__name__}: {exc}")
    return gc.Outcome(check.name, "planned", 0.0, {"timeout_s": check.timeout_s})


def verdict_of(outcomes: list[gc.Outcome], out: Path, device: str, dumps: dict[str, str]) -> dict[str, Any]:
    by_name = {o.name: o for o in outcomes}
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {}
    verdict = judge.judge_local(by_name, device) | judge.judge_memory(by_name, expected)
    verdict |= judge.judge_bench(by_name, out / "bench") | judge.judge_offload(by_name, dumps)
    return {**verdict, "not_run": gc.not_run(outcomes)}


def write(out: Path, info: dict[str, Any], rows: list[dict[str, Any]], outcomes: list[gc.Outcome], v: Any) -> None:
    """results.json and results.md, rewritten after every check (a cut leaves what finished)."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"env": info, "plan": rows, "checks": [asdict(o) for o in outcomes], "verdict": v}
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# The second GPU window (scripts/gpu_window.py)", "", f"`{json.dumps(info)[:600]}`", ""]
    lines += ["| check | box s | basis | status | s | notes |", "|---|---:|---|---|---:|---|"]
    done = {o.name: o for o in outcomes}
    for row in rows:
        o = done.get(row["name"])
        note = "" if o is None else (o.tail.strip().splitlines() or [""])[-1] or json.dumps(o.details)[:200]
        status, seconds = (o.status, o.seconds) if o else ("not reached", "")
        note = note[:200].replace("|", "/")
        lines.append(f"| {row['name']} | {row['box_s']} | {row['basis']} | {status} | {seconds} | {note} |")
    lines += ["", "Verdict: `" + json.dumps(v) + "`", ""]
    (out / "results.md").write_text("\n".join(lines))


def plan_rows(checks: list[gc.Check], budget_s: float) -> tuple[list[dict[str, Any]], list[str]]:
    kept, dropped = gc.fit({c.name: c.timeout_s for c in checks}, budget_s)
    basis = lambda n: "unsupported" if n in NOT_HERE else "measured" if n in MEASURED else "estimate"  # noqa: E731
    rows = [{"name": c.name, "box_s": c.timeout_s, "basis": basis(c.name), "kept": c.name in kept} for c in checks]
    return rows, dropped


def run(checks: list[gc.Check], out: Path, budget_s: float, device: str, dry: bool) -> int:
    """The checks in order within ``budget_s``; each check's full output in ``out/logs`` (gpu_check's ``LOGS``, put
    back afterwards), beside the results, so it comes back from the device."""
    logs, gc.LOGS = gc.LOGS, out / "logs"
    try:
        return run_checks(checks, out, budget_s, device, dry)
    finally:
        gc.LOGS = logs


def run_checks(checks: list[gc.Check], out: Path, budget_s: float, device: str, dry: bool) -> int:
    deadline = time.monotonic() + budget_s
    rows, dropped = plan_rows(checks, budget_s)
    info = {**gc.env_info(), "mode": "dry run" if dry else "run", "device_flag": device}
    outcomes: list[gc.Outcome] = []
    dumps = {c.name: c.dump for c in checks}
    for i, (check, row) in enumerate(zip(checks, rows, strict=True), 1):
        why = f"dropped: its {check.timeout_s} s box does not fit in {budget_s:.0f} s after the checks before it"
        if check.name in dropped and not dry:
            outcome = gc.Outcome(check.name, "skipped", 0.0, {"why": why})
        else:  # a dry run checks the set-up of a dropped check too
            outcome = outcome_of(check, device, dry, deadline - time.monotonic())
            if check.name in dropped and outcome.status == "planned":
                outcome = gc.Outcome(check.name, "skipped", 0.0, {"why": why})
        outcomes.append(outcome)
        write(out, info, rows, outcomes, verdict_of(outcomes, out, device, dumps))
        said = outcome.tail[-300:] or outcome.details.get("why", "")
        line = (
            f"{i:2}. {check.name}: box {check.timeout_s} s ({row['basis']}) -> {outcome.status} ({outcome.seconds} s)"
        )
        print(f"{line} {said}".rstrip(), flush=True)
    kept = sum(r["box_s"] for r in rows if r["kept"])
    print(f"plan: {len(checks)} checks, {kept} s of boxes kept of {budget_s:.0f} s; dropped: {dropped or 'none'}")
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return gc.exit_status(outcomes, passed=("planned",) if dry else ("ok",))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "outputs" / "gpu_window"), help="results.{json,md} and bench/")
    parser.add_argument("--work", default=str(REPO / "outputs" / "gpu_window" / "runs"), help="the runs' dumps")
    parser.add_argument("--budget-s", type=float, default=TOTAL_S, help=f"total time (default {TOTAL_S})")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (names as in the plan)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the rehearsal")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; validate every check's set-up")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    out = Path(args.out)
    checks = [c for c in plan(Path(args.work), out, args.device) if args.only is None or c.name in args.only]
    return run(checks, out, args.budget_s, args.device, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
