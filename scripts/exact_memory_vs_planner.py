"""The planner's memory terms beside the exact fake-tensor peak, per category, for every published layout the exact
step traces (docs/planner.md, "Exact memory"). Usage:

    PYTHONPATH=src python scripts/exact_memory_vs_planner.py [tests/fixtures/exact_memory.json]

The exact figures are the fixture scripts/exact_memory_fixture.py writes (tools/memory_run.py on each layout, eager
bf16); the planner's are plan/physics/peak.py's ``rank_allocated`` on the same eager layout: what a device allocates,
before the fitted allocator slack. Prints a markdown table (GiB, planner / exact)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshforge.plan.accuracy.exact import CATEGORY_GROUPS, exact_groups, planner_groups

GIB = 2**30


def table(path: Path) -> list[str]:
    names = list(CATEGORY_GROUPS)
    lines = [
        "| rows | world | exact peak | planner | error | " + " | ".join(names) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    for layout in json.loads(path.read_text())["layouts"]:
        exact = exact_groups(layout["by_category"])
        planner = planner_groups(layout["overrides"], layout["world_size"])
        pe, pp = sum(exact.values()), sum(planner.values())
        cells = " | ".join(f"{planner[k] / GIB:.2f} / {exact[k] / GIB:.2f}" for k in names)
        rows = ", ".join(layout["rows"])
        head = f"| {rows} | {layout['world_size']} | {pe / GIB:.2f} | {pp / GIB:.2f} | {100 * (pp / pe - 1):+.1f} %"
        lines.append(f"{head} | {cells} |")
    return lines


if __name__ == "__main__":
    print("\n".join(table(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/exact_memory.json"))))
