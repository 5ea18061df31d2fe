"""The held-out production layouts (plan/accuracy/production.py: Llama 3 405B at 8,192-16,384 H100s, never fitted)."""

from __future__ import annotations

import pytest

from meshforge.config.io import load_config
from meshforge.plan.accuracy import production, published
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import estimate

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


@pytest.mark.xfail(
    strict=True,
    reason="not met: 47-55 % below Llama 3's TFLOPs/GPU, as it is 40-51 % below Megatron-Core's (docs/planner.md)",
)
def test_held_out_tflops_within_15_percent(preds: list[production.HeldOutPrediction]) -> None:
    """The issue's bar, unmet (strict: passing would mean the notes and docs need updating)."""
    assert all(abs(p.error) <= production.TOLERANCE for p in preds), [round(p.error, 3) for p in preds]


def test_cross_stack_rows_encode_the_published_layouts() -> None:
    """NVIDIA's Megatron rows as the planner reads them: TP / PP / VP / CP / DP of the table, its global batch, and
    the AC reading the planner's most favourable (no faster mode fits 80 GB)."""
    want = {  # key: tp, pp, stages per rank, cp, dp, global batch
        "megatron.405b_1024": (8, 8, 8, 2, 8, 512),
        "megatron.70b_64": (4, 8, 5, 1, 2, 128),
        "megatron.8b_8": (1, 1, 1, 1, 8, 128),
    }
    h100 = load_hardware("h100")
    preds = production.predict_cross_stack(h100)
    assert [r.key for r, _, _ in preds] == list(want)
    for row, est, mode in preds:
        lay = est.layout
        dp = lay.dp_shard * lay.dp_replicate
        got = (
            lay.tp,
            lay.pp,
            lay.stages_per_rank if lay.pp > 1 else 1,
            lay.cp,
            dp,
            dp * lay.local_batch_size * lay.grad_accum,
        )
        assert got == want[row.key] and lay.world_size == row.world_size, (row.key, got)
        assert est.fits
        faster = production.AC_MODES[: production.AC_MODES.index(mode)]
        for other in faster:
            cfg = load_config(None, [*row.overrides, "--activation_checkpoint.mode", other])
            assert not estimate(layout_from_config(cfg, row.world_size, impl="torchtitan"), h100).fits
