"""Where a run's start-up goes, and how long a one-step `meshforge train` takes to reach its first step.

    python scripts/startup_time.py --repeat 5 [--before /work/main/src] [-- extra train args]
    python scripts/startup_time.py --phases

Without --phases: runs `python -m meshforge train --training.steps 1` repeatedly (alternating with the code under
--before when given, ABAB, so both see the same machine) and prints, per variant, the median time from process start
to the start of step 1 (the first metrics.jsonl line, minus that step's own step_time_s) and the whole wall time.
With --phases: one process, in-process timers around `import meshforge.train.loop` and each set-up phase of
``meshforge.train.loop.setup`` (by wrapping the module's functions; the training code is not changed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("init_distributed", "build_tokenizer", "build_dataloader", "build_model_parts", "build_optimizer",
          "build_metrics", "build_checkpointer")  # fmt: skip


def one_run(src: Path, extra: list[str]) -> tuple[float, float]:
    """(seconds to the start of step 1, wall seconds) of one `meshforge train --training.steps 1`: the parent
    notes when step 1's metrics line appears (polling every 10 ms) and subtracts the step's own step_time_s."""
    with tempfile.TemporaryDirectory(prefix="startup-") as dump:
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "meshforge", "train", "--training.steps", "1", "--job.dump_folder", dump, *extra]
        metrics = Path(dump) / "metrics.jsonl"
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
        seen = None
        while proc.poll() is None:
            if seen is None and metrics.is_file() and metrics.stat().st_size:
                seen = time.perf_counter() - start
            time.sleep(0.01)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"{cmd} failed: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        step = json.loads(metrics.read_text().splitlines()[0])
        return (seen if seen is not None else wall) - step["step_time_s"], wall


def compare(variants: dict[str, Path], repeat: int, extra: list[str]) -> dict[str, Any]:
    """Alternate the variants `repeat` times; medians of time-to-first-step and wall per variant."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, src in variants.items():
            times[name].append(one_run(src, extra))
    return {
        name: {
            "first_step_s": [round(t, 2) for t, _ in rows],
            "median_first_step_s": round(statistics.median(t for t, _ in rows), 2),
            "median_wall_s": round(statistics.median(w for _, w in rows), 2),
        }
        for name, rows in times.items()
    }


def phases(argv: list[str]) -> dict[str, Any]:
    """In-process: wall and CPU seconds (process_time: what a busy machine inflates least) of the training loop's
    import and of each set-up phase, and which heavy modules ended up imported."""
    spent: dict[str, float] = {}
    cpu0, start = time.process_time(), time.perf_counter()
    import meshforge.train.loop as loop
    from meshforge.config.io import load_config

    spent["import meshforge.train.loop"] = time.perf_counter() - start
    spent["import meshforge.train.loop (cpu)"] = time.process_time() - cpu0

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                spent[f"{name} (cpu)"] = spent.get(f"{name} (cpu)", 0.0) + time.process_time() - c

        return wrapper

    for name in PHASES:
        setattr(loop, name, timed(name, getattr(loop, name)))
    with tempfile.TemporaryDirectory(prefix="startup-") as dump:
        cfg = load_config(None, ["--training.steps", "1", "--job.dump_folder", dump, *argv])
        t, c = time.perf_counter(), time.process_time()
        loop.setup(cfg)
        spent["setup (total)"] = time.perf_counter() - t
        spent["setup (total, cpu)"] = time.process_time() - c
    spent["total to the first step (cpu)"] = time.process_time() - cpu0
    heavy = ("torch._dynamo", "torch._inductor", "torch.distributed.pipelining", "torch.distributed.checkpoint",
             "torchao", "torch.utils.tensorboard")  # fmt: skip
    return {**{k: round(v, 3) for k, v in spent.items()}, **{f"imported {m}": m in sys.modules for m in heavy}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", default="", help="a src/ folder of the code to compare with (e.g. main's)")
    parser.add_argument("--phases", action="store_true", help="time the import and each set-up phase in-process")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.phases:
        print(json.dumps(phases(extra), indent=1))
        return
    variants = {"after": REPO / "src"}
    if args.before:
        variants = {"before": Path(args.before).resolve(), **variants}
    load = os.getloadavg()[0]
    result = compare(variants, args.repeat, extra)
    print(json.dumps({"load_avg_1m_before": round(load, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
                      **result}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
