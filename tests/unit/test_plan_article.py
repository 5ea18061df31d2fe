"""The planner against the article's published tables (TorchTitan's Dec-2024 H100 report)."""

from __future__ import annotations

import pytest

from meshforge.plan import article
from meshforge.plan.hardware import load_hardware

pytestmark = pytest.mark.filterwarnings("ignore")


def test_article_tables_are_reproduced(capsys: pytest.CaptureFixture[str]) -> None:
    rows = article.reproduce(load_hardware("h100-96gb"))
    with capsys.disabled():
        print("\n" + article.format_rows(rows))
    summary = article.summary(rows)
    assert len(rows) == 10
    assert summary["tps_median"] <= 0.15
    assert summary["memory_median"] <= 0.10
    assert summary["tps_max"] <= 0.30
    assert summary["memory_max"] <= 0.30
    assert all(row.estimate.fits for row in rows), "every published run ran, so it must fit"


def test_article_directions_hold() -> None:
    """What each table demonstrates, in the model: compile and Float8 speed up, async TP speeds up, interleaving
    shrinks the bubble and the activation memory, longer context is slower per device."""
    tps = {row.case.name: row.estimate.tps_per_device for row in article.reproduce(load_hardware("h100-96gb"))}
    mem = {row.case.name: row.estimate.peak_memory_gib for row in article.reproduce(load_hardware("h100-96gb"))}
    assert tps["8B FSDP"] < tps["8B FSDP + compile"] < tps["8B FSDP + compile + Float8"]
    assert tps["70B FSDP 32 x TP 8"] < tps["70B FSDP 32 x TP 8 + async TP"]
    assert tps["405B 3D 1F1B"] < tps["405B 3D interleaved 1F1B"]
    assert mem["405B 3D interleaved 1F1B"] < mem["405B 3D 1F1B"]
    seqs = [tps[f"405B 4D seq {s} (FSDP {8 // c}, CP {c})"] for s, c in ((32768, 1), (65536, 2), (131072, 4))]
    assert seqs == sorted(seqs, reverse=True)


def test_mfu_matches_the_reports_statement() -> None:
    """The report: 8B FSDP without Float8 reaches 33-39 % MFU (against the SXM peak) without / with compile."""
    rows = article.reproduce(load_hardware("h100-96gb"))[:2]
    assert 30 <= rows[0].estimate.mfu_pct <= 36
    assert 36 <= rows[1].estimate.mfu_pct <= 42


def test_holdout_rows_of_the_same_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Rows no constant was fitted to: 8B on 128 GPUs, 8B context parallel, 405B at 262k, the older 405B 2D runs."""
    rows = article.reproduce(load_hardware("h100-96gb"), article.HOLDOUT)
    with capsys.disabled():
        print("\nhold-out:\n" + article.format_rows(rows))
    summary = article.summary(rows)
    assert summary["tps_median"] <= 0.15 and summary["tps_max"] <= 0.30
    assert summary["memory_median"] <= 0.15 and summary["memory_max"] <= 0.30


def test_shipped_constants_are_the_fit_to_the_article() -> None:
    """Refitting from the shipped defaults moves none of the fitted constants by more than rounding: a change to the
    physics that is not followed by a refit (docs/planner.md, "The constants") fails here."""
    from meshforge.plan import calibrate

    hw = load_hardware("h100-96gb")
    obs = [
        calibrate.Observation(r.case.name, r.estimate.layout, r.case.tps, r.case.memory_gib)
        for r in article.reproduce(hw)
    ]
    names = ("matmul", "attention", "float8_speedup", "async_tp_overlap")
    fitted = calibrate.fit_memory(obs, calibrate.fit_time(obs, hw, names), fit_slack=False)
    for name in (*names, "framework_gib"):
        assert getattr(fitted.efficiency, name) == pytest.approx(getattr(hw.efficiency, name), rel=0.05), name
