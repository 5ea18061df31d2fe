"""The bench report's measured guide: the fastest measured run and the predicted winner per model and rank count."""

from __future__ import annotations

from meshforge.bench import guide


def _run(label: str, world: int, tps: float, predicted: float, tp: int = 1, pp: int = 1) -> dict:
    layout = {"dp_replicate": 1, "dp_shard": world // (tp * pp), "tp": tp, "pp": pp, "cp": 1}
    return {
        "label": label,
        "world_size": world,
        "tps_per_device": tps,
        "predicted_tps_per_device": predicted,
        "layout": layout,
        "status": "ok",
        "group": "strategy",
        "flavor": "debugmodel",
        "seq_len": 128,
    }


def test_measured_and_predicted_winners() -> None:
    results = {
        "runs": [
            _run("FSDP 4", 4, 100.0, 90.0),
            _run("TP 4", 4, 80.0, 120.0, tp=4),
            _run("PP 4", 4, 120.0, 95.0, pp=4),
            _run("FSDP 2", 2, 50.0, 60.0),
            {**_run("broken", 4, 999.0, 999.0), "status": "failed"},
        ]
    }
    rows = {r["ranks"]: r for r in guide.guide_rows(results)}
    assert rows[4]["measured"] == "PP 4" and rows[4]["measured_family"] == "3D"
    assert rows[4]["predicted"] == "TP 4" and rows[4]["predicted_family"] == "FSDP x TP" and rows[4]["agree"] is False
    assert rows[2]["agree"] is True and rows[4]["runs"] == 3
    text = "\n".join(guide.guide_lines(results))
    assert "| debugmodel | 128 | 4 | 3 | PP 4 | 3D | 120.0 | TP 4 | FSDP x TP | no |" in text
