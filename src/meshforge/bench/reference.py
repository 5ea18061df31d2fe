"""The article's published figures (its tables 1-4, from TorchTitan's December-2024 H100 report), for
``meshforge bench --compare-with reference``.

Setups as the article and its source state them: 8x H100 SXM (96 GB HBM2e, 500 W) per node, 400 Gb/s RDMA, bf16 with
the named features, C4, AdamW. TPS/GPU read at step 90; memory is the maximum over GPUs. A measured run is compared
figure-for-figure only when its setup matches (flavor, world size, layout, sequence length); otherwise only the
relative gain over the table's first row is put beside the measured one. The rows themselves, with their sources, are
defined once in meshforge.plan.accuracy.published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshforge.config.io import load_config
from meshforge.errors import ConfigError
from meshforge.plan.accuracy import published
from meshforge.plan.layout import layout_from_config


@dataclass(frozen=True)
class ArticleFigure:
    """One row of one of the article's tables."""

    key: str
    table: str
    configuration: str
    flavor: str
    world_size: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    seq_len: int
    local_batch_size: int
    tps_per_gpu: float
    memory_gib: float
    baseline: str  # key of the table's first row: the ratio's denominator

    def matches(self, record: dict[str, Any]) -> bool:
        """Same model, world size, layout and sequence length: the figures can be put side by side."""
        layout = record.get("layout", {})
        return (
            record.get("flavor") == self.flavor
            and record.get("world_size") == self.world_size
            and record.get("seq_len") == self.seq_len
            and (layout.get("dp_shard"), layout.get("tp"), layout.get("pp"), layout.get("cp"))
            == (self.dp_shard, self.tp, self.pp, self.cp)
        )


def _figure(run: published.Run) -> ArticleFigure:
    """An article row as bench compares it: the layout its overrides give at its world size."""
    lay = layout_from_config(load_config(None, list(run.overrides)), run.world_size, impl="torchtitan")
    return ArticleFigure(
        run.key,
        published.TABLES[run.article_table],
        run.label,
        lay.flavor,
        run.world_size,
        lay.dp_shard,
        lay.tp,
        lay.pp,
        lay.cp,
        lay.seq_len,
        lay.local_batch_size,
        run.tps,
        run.memory_gib or 0.0,
        run.baseline,
    )


FIGURES: dict[str, ArticleFigure] = {r.key: _figure(r) for r in published.article_runs()}
"""The article's rows, derived from meshforge.plan.accuracy.published (the one definition of every published row)."""

CLAIMS = (
    "FSDP + compile + Float8 raises 8B throughput by 48% over FSDP and lowers memory by 7% (table 1).",
    "Async TP: +5.4% throughput, -5.9% memory for 70B 2D (table 2).",
    "Interleaved 1F1B: +28% throughput, -11.9% memory over 1F1B for 405B 3D (table 3).",
    "The 3D 8 x 8 x 8 layout keeps 89% scaling efficiency at 512 GPUs.",
)


def figure(key: str) -> ArticleFigure:
    """The article's row named ``key``; ValueError listing the keys otherwise."""
    if key not in FIGURES:
        raise ConfigError(f"reference = {key!r} is not one of the article's figures: {', '.join(FIGURES)}")
    return FIGURES[key]


def article_ratio(key: str) -> float:
    """Throughput of the row over its table's first row (1.0 for the first row)."""
    row = figure(key)
    return row.tps_per_gpu / figure(row.baseline).tps_per_gpu
