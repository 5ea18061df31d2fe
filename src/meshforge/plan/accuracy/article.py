"""The published rows (plan/accuracy/published.py) as the planner predicts them with the shipped constants.

``reproduce`` is in-sample for every row the shipped constants were fitted to (all of published.RUNS): the accuracy
that means something is the leave-one-out one (plan/accuracy/loo.py, ``meshforge plan --article`` prints both).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from meshforge.config.io import load_config
from meshforge.plan.accuracy import published
from meshforge.plan.accuracy.published import Run
from meshforge.plan.hardware import HardwareProfile, load_hardware
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import Estimate, estimate

ARTICLE_IMPL = "torchtitan"
CASES: tuple[Run, ...] = published.article_runs()
"""The article's tables 1-4 (TorchTitan's Dec-2024 report)."""
HOLDOUT: tuple[Run, ...] = tuple(r for r in published.RUNS if not r.article_table)
"""Every other published row (other tables of the same report and other sources)."""


@dataclass(frozen=True)
class Row:
    case: Run
    estimate: Estimate

    @property
    def tps_error(self) -> float:
        return self.estimate.tps_per_device / self.case.tps - 1

    @property
    def memory_error(self) -> float | None:
        """None where the source gives no memory."""
        return self.estimate.peak_memory_gib / self.case.memory_gib - 1 if self.case.memory_gib else None


def predict(case: Run, hw: HardwareProfile | None = None) -> Estimate:
    """The planner's prediction for one published setup (through the same config path as the CLI), on ``hw`` or the
    row's own hardware preset."""
    cfg = load_config(None, list(case.overrides))
    return estimate(layout_from_config(cfg, case.world_size, impl=ARTICLE_IMPL), hw or load_hardware(case.hardware))


def reproduce(hw: HardwareProfile | None = None, cases: tuple[Run, ...] = CASES) -> list[Row]:
    """Every row with the planner's prediction (on ``hw`` where given, else each row's own preset)."""
    return [Row(case, predict(case, hw if hw is not None and case.hardware == hw.name else None)) for case in cases]


def summary(rows: list[Row]) -> dict[str, float]:
    """Median and maximum absolute relative errors of TPS and memory."""
    tps = [abs(r.tps_error) for r in rows]
    mem = [abs(e) for r in rows if (e := r.memory_error) is not None]
    return {
        "tps_median": statistics.median(tps),
        "tps_max": max(tps),
        "memory_median": statistics.median(mem) if mem else 0.0,
        "memory_max": max(mem) if mem else 0.0,
    }


def format_rows(rows: list[Row]) -> str:
    """The predicted-vs-published table as Markdown (in-sample: the shipped constants saw these rows)."""
    lines = [
        "| table | setup | hardware | TPS/GPU published | predicted | error | memory GiB published | predicted "
        "| error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c, e, m = row.case, row.estimate, row.memory_error
        published_mem = f"{c.memory_gib:.1f}" if m is not None and c.memory_gib else "-"
        lines.append(
            f"| {c.article_table or c.source} | {c.name} | {c.hardware} | {c.tps:,.0f} | {e.tps_per_device:,.0f} | "
            f"{row.tps_error:+.1%} | {published_mem} | {e.peak_memory_gib:.1f} | {'-' if m is None else f'{m:+.1%}'} |"
        )
    s = summary(rows)
    lines.append(
        f"\nin-sample median |error|: TPS {s['tps_median']:.1%}, memory {s['memory_median']:.1%}; "
        f"max: TPS {s['tps_max']:.1%}, memory {s['memory_max']:.1%}"
    )
    return "\n".join(lines)
