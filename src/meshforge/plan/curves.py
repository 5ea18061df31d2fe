"""Throughput curves of the guide: predicted tokens/s per GPU vs GPU count, one curve per strategy family with its
interval as a band, per model and sequence length (PNG, matplotlib Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_curves(cells: Sequence[dict[str, Any]], hardware: str, out: Path, results: str | None = None) -> list[Path]:
    """Write one PNG per (model, sequence length); returns their paths."""
    from meshforge.plan.curves_plot import plot_all

    return plot_all(cells, hardware, out, results)
