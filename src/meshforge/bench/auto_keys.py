"""The keys a bench ``[[run]]`` with ``auto = true`` may not give: the planner picks them (bench/auto_rows.py).

Checked on the raw TOML tables (bench/matrix.py parse_matrix), so ``tp = 1`` written out is refused as well: the
pick may choose TP 2.
"""

from __future__ import annotations

from typing import Any

from meshforge.errors import ConfigError

LAYOUT_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "schedule", "compile", "float8", "async_tp", "ac_mode")
"""What the pick decides: an auto row may not set them."""


def check_auto_entries(entries: list[dict[str, Any]]) -> None:
    """The raw ``[[run]]`` tables: an ``auto = true`` row that also gives a layout key is refused in one line."""
    for i, entry in enumerate(entries):
        if entry.get("auto") is not True:
            continue
        given = [k for k in LAYOUT_KEYS if k in entry]
        if given:
            raise ConfigError(
                f"run[{i}] {entry.get('name', '')!r}: auto = true with {given[0]} = {entry[given[0]]!r}; the planner "
                f"picks the layout, so drop {', '.join(given)} (or drop auto to give the layout yourself)"
            )
