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
