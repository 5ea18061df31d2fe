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


def test_held_out_rows_encode_the_paper_and_are_not_fitted(preds: list[production.HeldOutPrediction]) -> None:
    """Not fitted rows; Table 4's world sizes and CP; section 3.3.2's AC: none at 8K, full (not stated) at 128K."""
    assert {p.row.key for p in preds}.isdisjoint(r.key for r in published.RUNS)
    for p in preds:
        assert p.estimate.layout.world_size == p.row.world_size >= 8192
    assert [p.estimate.layout.cp for p in preds] == [1, 1, 16]
    assert [p.estimate.layout.seq_len for p in preds] == [8192, 8192, 131072]
    assert [p.estimate.layout.ac_mode for p in preds] == ["none", "none", "full"]


def test_earlier_reading_fits_80_gb_on_every_row() -> None:
    """Full AC (``READING_BEFORE``) is a layout the model admits on every row: the rows ran, so some reading must."""
    for p in production.predict_held_out(ac_mode="full"):
        assert p.estimate.capacity_gib < 80 and p.estimate.fits, (p.row.key, p.estimate.peak_memory_gib)


@pytest.mark.xfail(
    strict=True,
    reason="the model's memory disagrees with the paper: 98-130 GiB for the 8K rows without AC, which Meta ran in "
    "80 GB (its schedule and memory work are not modelled; production.py docstring)",
)
def test_held_out_rows_fit_their_80_gb_as_read(preds: list[production.HeldOutPrediction]) -> None:
    """Every published production run ran, so each should be predicted to fit on its 80 GB H100 as the paper ran it."""
    assert all(p.estimate.fits for p in preds), [round(p.estimate.peak_memory_gib) for p in preds]


@pytest.mark.xfail(
    strict=True,
    reason="not met on the TorchTitan-fitted h100 constants: 29-55 % below Llama 3's TFLOPs/GPU, as they are 40-51 % "
    "below Megatron-Core's (docs/planner.md); the nemo-h100-bf16 profile meets it (test_plan_stack.py)",
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
