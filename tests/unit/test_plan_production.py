"""The held-out production layouts (plan/production.py: Llama 3 405B at 8,192-16,384 H100s, never fitted)."""

from __future__ import annotations

import pytest

from meshforge.plan import production, published

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def preds() -> list[production.HeldOutPrediction]:
    return production.predict_held_out()


def test_held_out_rows_fit_their_80_gb_and_are_not_fitted(preds: list[production.HeldOutPrediction]) -> None:
    """Every published production run ran, so each is predicted to fit on its 80 GB H100; none is a fitted row."""
    assert {p.row.key for p in preds}.isdisjoint(r.key for r in published.RUNS)
    for p in preds:
        assert p.estimate.capacity_gib < 80 and p.estimate.fits, (p.row.key, p.estimate.peak_memory_gib)
        assert p.estimate.layout.world_size == p.row.world_size >= 8192
    assert [p.estimate.layout.cp for p in preds] == [1, 1, 16]


@pytest.mark.xfail(strict=True, reason="not met: the model predicts 47-55 % below Llama 3's TFLOPs/GPU (notes)")
def test_held_out_tflops_within_15_percent(preds: list[production.HeldOutPrediction]) -> None:
    """The issue's bar, unmet (strict: passing would mean the notes and docs need updating)."""
    assert all(abs(p.error) <= production.TOLERANCE for p in preds), [round(p.error, 3) for p in preds]
