"""Bench rows with ``auto = true`` (bench/auto_rows.py): resolved with train --parallelism.auto's own pick, labelled
``auto -> <layout>``, the pick's runner-up and why recorded; an auto row that also gives a layout is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from meshforge.bench import auto_rows
from meshforge.bench.matrix import parse_matrix
from meshforge.config.io import ConfigError, load_config
from meshforge.plan.guide import auto
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_from_config

HEAD = {
    "name": "t", "flavor": "debugmodel", "seq_len": 128, "global_batch_size": 4, "warmup_steps": 1,
    "measured_steps": 2, "dtype": "float32", "ac_mode": "none", "cores": 4,
}  # fmt: skip
KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "schedule", "microbatch_size", "ac_mode", "compile", "float8")


def _tree(**run: Any) -> dict[str, Any]:
    overrides = {"parallelism.pipeline_parallel_microbatch_size": 2}  # the pick's microbatch must win over this
    return {"bench": {**HEAD, "overrides": overrides}, "run": [{"name": "fsdp", "ranks": 4}, {"name": "a", **run}]}


@pytest.fixture
def no_exact_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact fake-tensor run admits everything (tests/unit/test_plan_auto.py runs it for real)."""
    monkeypatch.setattr(auto, "exact_peak_gib", lambda cfg, world: 0.01)


def test_an_auto_row_runs_train_autos_pick(no_exact_run: None) -> None:
    matrix = parse_matrix(_tree(ranks=4, auto=True), device="cpu")
    resolved, picks = auto_rows.resolve_auto_rows(matrix, "cpu", "cpu")
    run = resolved.run("a")
    hw = load_hardware("cpu")
    expected = auto.pick(*reversed(matrix.config_and_overrides(matrix.run("a"))), 4, hw).chosen.layout
    got = layout_from_config(load_config(*resolved.config_and_overrides(run)), 4)
    assert {k: getattr(got, k) for k in KEYS} == {k: getattr(expected, k) for k in KEYS}
    assert got.local_batch_size * got.dp == 4  # the bench's global batch
    assert run.describe() == f"auto -> {replace(run, label='').describe()}"  # "auto -> PP 4 (1F1B) + compile"
    assert picks["a"]["picked"] == expected.describe() and picks["a"]["runner_up"]
    assert "runner-up" in picks["a"]["why"] and resolved.run("fsdp") == matrix.run("fsdp")


def test_the_profile_is_hardware_else_the_device_default() -> None:
    assert auto_rows.profile_name("h100", "cpu") == "h100"
    assert auto_rows.profile_name("", "cpu") == auto_rows.profile_name("none", "cpu") == "cpu"
    assert auto_rows.profile_name("", "cuda") == "h100"


@pytest.mark.parametrize("key, value", [("pp", 2), ("tp", 1), ("compile", True), ("schedule", "1F1B")])
def test_auto_with_a_layout_is_one_line(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"auto = true with {key} = ") as err:
        parse_matrix(_tree(ranks=4, auto=True, **{key: value}), device="cpu")
    assert "\n" not in str(err.value)


def test_a_non_bool_auto_is_refused() -> None:
    with pytest.raises(ConfigError, match="auto = 'yes' must be bool"):
        parse_matrix(_tree(ranks=4, auto="yes"), device="cpu")


def test_the_report_puts_the_pick_beside_the_fastest_measured_run() -> None:
    pick = {
        "hardware": "cpu", "picked": "PP 4 (1F1B, 4 x mb 1)", "predicted_tps_per_device": 1000.0,
        "runner_up": "FSDP 2 x PP 2", "runner_up_tps_per_device": 950.0,
    }  # fmt: skip
    runs = [
        {"name": "a", "label": "auto -> PP 4 (1F1B)", "world_size": 4, "tps_per_device": 400.0, "auto": pick},
        {"name": "pp", "label": "FSDP 2 x PP 2 (1F1B)", "world_size": 4, "tps_per_device": 450.0, "status": "ok"},
        {"name": "slow", "label": "FSDP 4", "world_size": 4, "tps_per_device": 300.0, "status": "ok"},
        {"name": "two", "label": "PP 2", "world_size": 2, "tps_per_device": 900.0, "status": "ok"},
    ]
    text = "\n".join(auto_rows.report_lines({"runs": runs}))
    assert "predicted 1,000.0, measured 400.0" in text and "runner-up FSDP 2 x PP 2 (predicted 950.0)" in text
    assert "fastest measured at 4 ranks: FSDP 2 x PP 2 (1F1B), 450.0" in text
    assert auto_rows.report_lines({"runs": runs[1:]}) == []


def test_the_shipped_auto_preset_resolves_at_4_ranks(no_exact_run: None) -> None:
    """configs/bench/auto.toml: its auto row and every other row at 4 ranks on the default's job."""
    from meshforge.bench.matrix import load_matrix

    matrix = load_matrix("configs/bench/auto.toml")
    assert [r.name for r in matrix.runs if r.auto] == ["auto"] and {r.ranks for r in matrix.runs} == {4}
    resolved, picks = auto_rows.resolve_auto_rows(matrix, "cpu", "cpu")
    assert resolved.run("auto").describe().startswith("auto -> ") and not any(r.auto for r in resolved.runs)
    assert picks["auto"]["hardware"] == "cpu"
