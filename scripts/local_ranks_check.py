"""Issue 46 item 1 on one device: every layout ``meshforge train --local-ranks N`` runs (docs/parallelism.md, "Several
ranks in one process"), against one process on the same device: losses and gradient norms within the parity
tolerance. On one GPU this runs the sharded CUDA kernels of TP, SP, loss parallel, CP, FSDP and EP that two ranks on
one GPU cannot (NCCL refuses them); on a CPU it is the rehearsal.

    python scripts/local_ranks_check.py --device cuda --out docs/benchmarks/gpu   # the window
    python scripts/local_ranks_check.py --dry-run                                 # anywhere: the plan and its boxes

Each run is a subprocess with its own time box (``BOX_S``); the runs are ordered by value (what one GPU could not
run before first) and a run whose box does not fit in what is left of ``--budget-s`` is skipped, named in the
results. Every finished run appends one JSON line to ``<out>/local_ranks.jsonl`` at once, so a cut leaves what
finished.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RTOL = {"loss": 1e-5, "grad_norm": 1e-6}  # tests/parity.py: fp32 losses 1e-5, gradient norms 1e-6
BASE = ["--training.seq_len", "64", "--training.steps", "2", "--training.deterministic", "--metrics.log_freq", "1"]
BASE += [
    "--training.mixed_precision_param",
    "float32",
    "--activation_checkpoint.mode",
    "none",
    "--optimizer.lr",
    "3e-3",
]
SHAPES = {
    "dense": ["--model.flavor", "debugmodel", "--model.n_layers", "2"],
    "moe": ["--model.flavor", "debugmoe", "--model.n_layers", "2"],  # layer 1 is the MoE layer
}
RUNS: dict[str, tuple[str, int, list[str]]] = {  # name: (shape, local ranks (0: one process), overrides); batch 8
    "dense_ref": ("dense", 0, ["--training.local_batch_size", "8"]),
    "local_tp2": ("dense", 2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "local_cp2": ("dense", 2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    "local_fsdp2": ("dense", 2, ["--training.local_batch_size", "4"]),
    "moe_ref": ("moe", 0, ["--training.local_batch_size", "8"]),
    "local_ep2": ("moe", 2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
    "local_fsdp2_tp2": ("dense", 4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
}
REFERENCE = {"dense": "dense_ref", "moe": "moe_ref"}
MEASURED_CPU_S = {
    "dense_ref": 21.9,
    "local_tp2": 35.2,
    "local_cp2": 31.2,
    "local_fsdp2": 31.2,
    "moe_ref": 24.8,
    "local_ep2": 26.6,
    "local_fsdp2_tp2": 33.8,
}
"""Wall seconds of each run of ``--device cpu`` (AMD EPYC, 2 cores shared with ~7 other jobs: load 9, torch
2.13.0+cpu, 2026-12-06), start-up included; every run's values within the tolerance (max relative difference: losses
1.2e-7, gradient norms 2.4e-9)."""
BOX_S = {name: round(1.5 * s) for name, s in MEASURED_CPU_S.items()}
"""1.5 x the CPU wall. Under local ranks the per-op Python dispatch of each simulated rank dominates a step, on a GPU
as on a CPU; a CUDA context adds seconds to start-up; the GPU's times are not measured (no GPU was lent)."""
BUDGET_S = 330


def argv_of(name: str, device: str, dump: Path) -> list[str]:
    shape, ranks, overrides = RUNS[name]
    local = ["--local-ranks", str(ranks)] if ranks else []
    extra = [*BASE, *SHAPES[shape], *overrides, "--training.device", device, "--job.dump_folder", str(dump)]
    return [sys.executable, "-m", "meshforge", "train", *local, *extra]


def run_one(name: str, device: str, work: Path, box_s: float) -> dict[str, Any]:
    """One run in a subprocess within ``box_s``: its status, seconds, losses and gradient norms."""
    dump = work / name
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            argv_of(name, device, dump), cwd=REPO, env=env, capture_output=True, text=True, timeout=box_s
        )
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "timeout", "seconds": round(time.monotonic() - start, 1), "box_s": box_s}
    out: dict[str, Any] = {"name": name, "seconds": round(time.monotonic() - start, 1), "box_s": box_s}
    if done.returncode != 0:
        return {**out, "status": "failed", "returncode": done.returncode, "tail": done.stderr[-1500:]}
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line]
    return {**out, "status": "ok", "loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}


def judge(result: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """A local-ranks run against its one-process reference: ``wrong`` past the tolerance, ``unchecked`` without one."""
    if result["status"] != "ok" or RUNS[result["name"]][1] == 0:
        return result
    if reference is None or reference["status"] != "ok":
        return {**result, "status": "unchecked"}
    diffs = {}
    for key, rtol in RTOL.items():
        got, want = result[key], reference[key]
        diff = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) if len(got) == len(want) else 1.0
        diffs[f"{key}_max_rel_diff"] = diff
        if not diff <= rtol:
            result = {**result, "status": "wrong"}
    return {**result, **diffs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=str(REPO / "outputs" / "local_ranks_check"), help="local_ranks.jsonl's folder")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--only", nargs="*", default=None, help="these runs (and their references)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its boxes; check every config")
    args = parser.parse_args(argv)
    names = [n for n in RUNS if args.only is None or n in args.only or n in {REFERENCE[RUNS[o][0]] for o in args.only}]
    if args.dry_run:
        return dry_run(names, args.device, args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline, done = time.monotonic() + args.budget_s, {}
    work = Path(tempfile.mkdtemp(prefix="local-ranks-check-"))
    for name in names:
        left = deadline - time.monotonic()
        if BOX_S[name] > left:
            result = {"name": name, "status": "skipped", "why": f"its {BOX_S[name]} s box > {left:.0f} s left"}
        else:
            result = run_one(name, args.device, work, BOX_S[name])
            result = judge(result, done.get(REFERENCE[RUNS[name][0]]))
        done[name] = result
        with (out / "local_ranks.jsonl").open("a") as f:  # at once: a cut leaves what finished
            f.write(json.dumps({**result, "device": args.device}) + "\n")
        print(f"{name}: {result['status']} ({result.get('seconds', 0)} s)", flush=True)
    return 0 if all(r["status"] in ("ok", "skipped") for r in done.values()) else 1


def dry_run(names: list[str], device: str, budget_s: float) -> int:
    """Each run's command line and box, and the total against the budget; every config loads and its layout fits
    its ranks with nothing local ranks refuse (parallel/local_ranks.py)."""
    sys.path.insert(0, str(REPO / "src"))
    from meshforge.config.io import load_config
    from meshforge.parallel.degrees import degrees_from_config
    from meshforge.parallel.local_ranks import refusal

    for name in names:
        cli = argv_of(name, device, Path("DUMP"))[4:]
        flags = [a for i, a in enumerate(cli) if a != "--local-ranks" and (i == 0 or cli[i - 1] != "--local-ranks")]
        ranks = RUNS[name][1]
        cfg = load_config(None, [*flags, "--parallelism.local_ranks", str(ranks)])
        why = refusal(cfg, degrees_from_config(cfg.parallelism, max(ranks, 1)))
        assert not why, f"{name}: {why}"
        print(f"{name}: box {BOX_S[name]} s: meshforge train {' '.join(cli)}")
    total = sum(BOX_S[n] for n in names)
    print(f"total {total} s of boxes, budget {budget_s:.0f} s: {'fits' if total <= budget_s else 'does NOT fit'}")
    return 0 if total <= budget_s else 1


if __name__ == "__main__":
    sys.exit(main())
