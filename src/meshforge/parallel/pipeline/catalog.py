"""The pipeline schedules meshforge knows, as facts both training and the planner read. Pure Python (no torch).

Each schedule has a stage style (one stage per rank; several looped ones, stage s on rank s % pp; or two in a V, stages
i and 2p-1-i on rank i) and either a full backward or one split into input- and weight-gradient halves.
"""

from __future__ import annotations

from typing import Literal

Style = Literal["single", "loop", "v"]

SCHEDULE_STYLES: dict[str, tuple[Style, bool]] = {
    # name: (stage style, splits the backward into input (I) and weight (W) gradients)
    "GPipe": ("single", False),
    "1F1B": ("single", False),
    "Interleaved1F1B": ("loop", False),
    "LoopedBFS": ("loop", False),
    "InterleavedZeroBubble": ("loop", True),
    "ZBVZeroBubble": ("v", True),
    "DualPipeV": ("v", True),
}
SCHEDULES = tuple(SCHEDULE_STYLES)
MULTI_STAGE = frozenset(name for name, (style, _) in SCHEDULE_STYLES.items() if style != "single")
V_SHAPED = frozenset(name for name, (style, _) in SCHEDULE_STYLES.items() if style == "v")
SPLIT_BACKWARD = frozenset(name for name, (_, split) in SCHEDULE_STYLES.items() if split)
"""Schedules that split the backward into input and weight gradients."""
ALIASES = {"interleave1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").removeprefix("schedule")


def canonical_schedule(name: str) -> str | None:
    """The canonical name (case-insensitive; torch class names such as Schedule1F1B and interleave_1f1b work), or
    None for a name no schedule has."""
    table = {_key(n): n for n in SCHEDULES} | ALIASES
    return table.get(_key(name))


def stages_of_rank(schedule: str, pp: int, stages_per_rank: int, rank: int) -> list[int]:
    """Stage indices a pipeline rank holds: looped (r, r + pp, ...) or V-shaped (r, 2 pp - 1 - r)."""
    if schedule in V_SHAPED and stages_per_rank == 2:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]
