"""Memory measured against the exact step and the planner (issue 46.4), for scripts/gpu_window.py.

    python scripts/gpu_window_memory.py measure TRAIN_FLAGS...   # on the GPU: meshforge train in this process, then
                                                                  # RESULT {max_memory_allocated / reserved GiB}
    python scripts/gpu_window_memory.py expect                    # here (CPU): docs/benchmarks/gpu/memory_expected.json

``measure`` trains with ``--metrics.log_freq 1``, which resets the peak counters at every logged step, so the figures
printed are the LAST step's peaks (a steady step: the optimizer state exists from step 1 on), the step that
``meshforge train --dry-run --memory`` traces. ``expect`` writes, for every memory check of the window's plan, the
exact step's peak (``train --dry-run --memory --json --world-size 1``, tensors only) and the planner's
(``meshforge plan --json --world-size 1 --hardware h100``) for the same flags: pure computation, so it runs before
the window and travels with the tree; the window's dry run refuses a plan whose flags the file does not hold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXPECTED = REPO / "docs" / "benchmarks" / "gpu" / "memory_expected.json"
GIB = 2**30


def measure(flags: list[str]) -> dict[str, Any]:
    """Train with ``flags`` in this process; the last step's CUDA peaks (None on a CPU)."""
    sys.path.insert(0, str(REPO / "src"))
    import torch

    from meshforge.cli import main

    code = main(["train", *flags])
    out: dict[str, Any] = {"returncode": code, "correct": code == 0}
    if torch.cuda.is_available():
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        out["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
        out["device_total_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    return out


def last_json(text: str) -> dict[str, Any]:
    line = [ln for ln in text.splitlines() if ln.startswith("{")][-1]
    return dict(json.loads(line))


def expect_one(flags: list[str]) -> dict[str, Any]:
    """The exact step's and the planner's peak for ``flags`` (one rank)."""
    run = [sys.executable, "-m", "meshforge"]
    env = {"PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    shape = [f for f in flags if f != "--training.deterministic"]
    exact = subprocess.run(
        [*run, "train", "--dry-run", "--memory", "--json", "--world-size", "1", *shape],
        capture_output=True, text=True, env=env, cwd=REPO, check=True,
    )  # fmt: skip
    plan_flags = [f for f in shape if f not in ("--training.device", "cuda")]
    planner = subprocess.run(
        [*run, "plan", "--json", "--world-size", "1", "--hardware", "h100", *plan_flags],
        capture_output=True, text=True, env=env, cwd=REPO, check=True,
    )  # fmt: skip
    e, p = last_json(exact.stdout), json.loads(planner.stdout)
    return {
        "exact_peak_gib": e["peak_gib"],
        "exact_by_category": e["by_category"],
        "planner_peak_gib": p["peak_memory_gib"],
    }


def expect(checks: dict[str, list[str]], path: Path = EXPECTED) -> None:
    """Write the expectation of every memory check (name -> its train flags), one check at a time (kept as it goes)."""
    data: dict[str, Any] = {}  # recomputed whole: the model, the exact step and the planner move under unchanged flags
    for name, flags in checks.items():
        data[name] = {"flags": flags, **expect_one(flags)}
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{name}: {data[name]['exact_peak_gib']} GiB exact, {data[name]['planner_peak_gib']} GiB planner")


def main(argv: list[str]) -> int:
    if argv[:1] == ["measure"]:
        print("RESULT " + json.dumps(measure(argv[1:])), flush=True)
        return 0
    if argv[:1] == ["expect"]:
        sys.path.insert(0, str(REPO / "scripts"))
        import gpu_window

        expect({c.name: c.overrides for c in gpu_window.plan(Path("DUMP")) if c.name.startswith("mem_")})
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
