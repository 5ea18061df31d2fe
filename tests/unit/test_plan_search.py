"""`meshforge plan --search` on the article's three cases: a fitting recommendation, the article's layout beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshforge.config.io import ConfigError, load_config
from meshforge.model.flavors import get_flavor
from meshforge.plan import report
from meshforge.plan.accuracy import article
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout, layout_from_config
from meshforge.plan.search import advisor

CASES = {"8B": article.CASES[0], "70B": article.CASES[3], "405B": article.CASES[6]}


@pytest.mark.parametrize("name", list(CASES))
def test_search_recommends_a_fitting_layout(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    case, hw = CASES[name], load_hardware("h100-96gb")
    base = layout_from_config(load_config(None, list(case.overrides)), case.world_size)
    result = advisor.search(base, case.world_size, hw)
    best = result.best
    assert best.fits and best.layout.world_size == case.world_size
    assert best.layout.local_batch_size * best.layout.dp == base.local_batch_size * base.dp  # same global batch
    assert result.baseline is not None and result.baseline.layout == base
    assert all(e.fits for e in result.ranked)
    floor = (1 - advisor.SIMPLICITY_MARGIN) * max(e.tps_per_device for e in result.ranked)
    assert best.tps_per_device >= floor
    if result.baseline.fits:
        assert best.tps_per_device >= (1 - advisor.SIMPLICITY_MARGIN) * result.baseline.tps_per_device
    text = report.format_search(result, hw)
    assert "recommended" in text and "your config" in text and "why this TP degree" in text
    with capsys.disabled():
        print(
            f"\n{name}: recommended {best.layout.describe()} -> {best.tps_per_device:,.0f} tok/s/device, "
            f"{best.peak_memory_gib:.1f} GiB; article's layout {result.baseline.layout.describe()} -> "
            f"{result.baseline.tps_per_device:,.0f}, {result.baseline.peak_memory_gib:.1f} GiB "
            f"({'fits' if result.baseline.fits else 'does not fit'})"
        )


def test_search_respects_meshforge_rules() -> None:
    """Zero-bubble schedules never come with compile (meshforge refuses it); Float8 only with fp8 tensor cores."""
    case = CASES["8B"]
    base = layout_from_config(load_config(None, list(case.overrides)), case.world_size)
    for hw_name, fp8 in (("h100-96gb", True), ("a100", False)):
        result = advisor.search(base, 8, load_hardware(hw_name))
        for est in result.ranked:
            lay = est.layout
            assert not (lay.compile and lay.schedule in ("ZBVZeroBubble", "InterleavedZeroBubble") and lay.pp > 1)
            assert fp8 or not lay.float8


def test_zero_bubble_with_per_op_selective_ac_is_refused_as_training_refuses_it() -> None:
    """parallel/pipeline/stage.py refuses split-backward schedules under per-op selective AC; the planner must not
    recommend what training would refuse."""
    args = get_flavor("8B")
    layout = Layout(
        flavor="8B", seq_len=8192, local_batch_size=8, dp_shard=4, pp=2, schedule="ZBVZeroBubble",
        stages_per_rank=2, ac_mode="selective", sac_option="op", reshard_after_forward=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="per-op selective AC"):
        layout.check(args)
    replace(layout, ac_mode="full").check(args)
