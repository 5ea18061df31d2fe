"""Run the exact fake-tensor memory step (tools/memory_run.py) on every published layout it can trace and write
rank 0's peak bytes by category to tests/fixtures/exact_memory.json, the reference tests/unit/test_plan_memory_exact.py
holds plan/physics/memory.py's per-category terms to. Usage:

    PYTHONPATH=src python scripts/exact_memory_fixture.py [OUT]

A layout is a published row's config (TorchTitan's rows, plan/accuracy/published.py, and NeMo's at-scale rows,
plan/accuracy/at_scale.py) as the step runs it (eager bf16: compile and Float8 swapped, as `meshforge train --dry-run
--memory` does) on its world size; rows sharing one are traced once. Pipeline-parallel rows are traced per stage by
tools/memory_pp.py. About 25 min on 2 CPU cores under load."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from meshforge.config.io import load_config
from meshforge.errors import ConfigError
from meshforge.plan.accuracy.at_scale import NEMO_ROWS, NemoRow
from meshforge.plan.accuracy.published import RUNS
from meshforge.tools.memory_cli import exact_memory

OUT = Path("tests/fixtures/exact_memory.json")
SWAPPED = ("--compile.enable", "--quantize.dense.float8.enable", "--parallelism.enable_async_tensor_parallel")


def eager_overrides(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """A row's overrides without the options the fake step swaps for eager bf16 (they do not change its layout)."""
    return tuple(o for o in overrides if o not in SWAPPED)


def main(out: Path) -> int:
    records: dict[str, dict[str, object]] = {}
    for row in (*RUNS, *NEMO_ROWS):
        published = row.as_published.split() if isinstance(row, NemoRow) else row.overrides
        overrides = eager_overrides(tuple(published))
        key = f"{row.world_size}:{' '.join(overrides)}"
        if key in records:
            records[key]["rows"].append(row.key)  # type: ignore[attr-defined]
            continue
        start = time.monotonic()
        try:
            _, run = exact_memory(load_config(None, list(overrides)), row.world_size)
        except ConfigError as exc:
            print(f"{row.key}: skipped ({exc})", file=sys.stderr)
            continue
        records[key] = {
            "rows": [row.key],
            "world_size": row.world_size,
            "overrides": list(overrides),
            "by_category": dict(sorted(run.by_category.items())),
            "scaling": run.scaling(),
            "notes": run.notes,
        }
        print(f"{row.key}: {run.peak_bytes / 2**30:.2f} GiB ({time.monotonic() - start:.0f} s)", file=sys.stderr)
    out.write_text(json.dumps({"layouts": list(records.values())}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
