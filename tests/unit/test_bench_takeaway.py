"""The report's first lines (bench/takeaway.py): the ranking with what is separable, the precision, the article's
gains, the planner's order, and the rows not ranked."""

from __future__ import annotations

from typing import Any

import numpy as np

from meshforge.bench.analysis import attach_ratios
from meshforge.bench.takeaway import takeaway_lines


def record(name: str, level: float, noise: float, seed: int, **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    steps = [list(level * (1 + noise * rng.standard_normal(4))) for _ in range(3)]
    return {
        "name": name, "status": "ok", "group": "strategy", "world_size": 2, "seq_len": 128, "tps_steps": steps,
        "tps_per_device": float(np.median(np.concatenate(steps))), "tps_per_device_ci_half_width": 0.03,
        "repetitions": [{}] * 3, "reference": "", "peak_memory_gib": 0.5, "oversubscribed": False, **extra,
    }  # fmt: skip


def sweep() -> dict[str, Any]:
    runs = [
        record("fsdp", 100, 0.01, 1, reference="table1.fsdp", predicted_tps_per_device=90.0, prediction_error=-0.1),
        record("fsdp_compile", 130, 0.01, 2, reference="table1.fsdp_compile", predicted_tps_per_device=85.0,
               prediction_error=-0.34),
        record("pp_1f1b", 131, 0.01, 3, predicted_tps_per_device=200.0, prediction_error=0.53,
               tps_per_device_ci_half_width=0.07),
        record("3d", 40, 0.01, 4, world_size=8, oversubscribed=True,
               parity={"max_rel_diff": 1.2e-7, "ok": True}),
    ]  # fmt: skip
    return {
        "bench": {"baseline": "fsdp", "confidence": 0.95},
        "machine": {"cpu_cores": 2, "busy_cores_before": 0.0},
        "sweep": {"stopping": {"target_half_width": 0.05}},
        "runs": runs,
    }


def test_takeaway_says_ranking_precision_article_planner_and_unranked() -> None:
    results = sweep()
    attach_ratios(results)
    text = "\n".join(takeaway_lines(results))
    assert text.startswith("## Takeaway") and "Read with care" not in text
    ranking = next(line for line in text.splitlines() if line.startswith("- **Ranking** at 2 ranks"))
    assert "`pp_1f1b` 1.30x ~ `fsdp_compile` 1.29x **>** `fsdp` 1.00x" in ranking
    assert "1 of 2 neighbouring pairs are separable" in ranking and "`3d`" not in ranking  # 3d: not ranked
    assert "1 still wider than +-5%" in text and "`pp_1f1b`" in text.split("**Precision**")[1]
    assert "FSDP + compile 1.29x here vs 1.16x (Table 1)" in text
    assert "orders 2 of 3 pairs" in text and "would pick `pp_1f1b`" in text and "median absolute error 34%" in text
    assert "`3d` (8 ranks: loss within 1.2e-07, 0.500 GiB)" in text


def test_a_noisy_sweep_opens_with_a_caution() -> None:
    results = sweep()
    results["machine"]["busy_cores_before"] = 1.8
    attach_ratios(results)
    assert "Read with care" in takeaway_lines(results)[2]
