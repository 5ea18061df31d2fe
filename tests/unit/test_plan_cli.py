"""`meshforge plan` from the command line: JSON keys, text output, custom hardware files, one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshforge.cli import main
from meshforge.plan.hardware import load_hardware

JOB_8B = ["--model.flavor", "8B", "--training.seq_len", "8192", "--training.local_batch_size", "2"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_promised_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "h100", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    for key in ("tps_per_device", "peak_memory_gib", "mfu_pct", "fits", "breakdown"):
        assert key in data
    assert set(data["breakdown"]["memory_gib"]) >= {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "communication_buffers",
        "framework_overhead",
    }
    assert set(data["breakdown"]["step_time_s"]) >= {
        "compute",
        "exposed_fsdp_comm",
        "exposed_tp_comm",
        "exposed_pp_comm",
        "exposed_cp_comm",
        "pipeline_bubble",
    }
    parts = sum(data["breakdown"]["memory_gib"].values())
    assert parts == pytest.approx(data["peak_memory_gib"], abs=0.05)


def test_config_file_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        [
            "--config",
            "configs/llama3_405b.toml",
            "--world-size",
            "512",
            "--hardware",
            "h100-96gb",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
        ],
        capsys,
    )
    assert code == 0
    assert "TP 8 x PP 8 (1F1B" in out and "tokens/s per device" in out and "pipeline bubble" in out


def test_layout_that_does_not_fit_reports_fits_false(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        [
            "--model.flavor",
            "405B",
            "--training.seq_len",
            "8192",
            "--training.local_batch_size",
            "1",
            "--world-size",
            "8",
            "--hardware",
            "h100",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is False and data["peak_memory_gib"] > data["capacity_gib"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--world-size", "8", "--hardware", "tpu-v9"], "--hardware 'tpu-v9'"),
        (["--world-size", "6", "--hardware", "h100", "--parallelism.tensor_parallel_degree", "4"], "not divisible"),
        (["--world-size", "6", "--hardware", "h100", "--parallelism.tensor_parallel_degree", "3"], "does not divide"),
        (["--world-size", "8", "--hardware", "h100", "--parallelism.data_parallel_shard_degree", "2"], "but --world"),
        (["--world-size", "8"], "--hardware is required"),
        (["--hardware", "h100"], "--world-size N is required"),
        (["--world-size", "x8", "--hardware", "h100"], "invalid int value"),
        (["--world-size", "8", "--hardware", "h100", "--training.nope", "1"], "unknown config key"),
        (["--calibrate", "/nonexistent/results.json", "--hardware", "h100"], "no such file"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_custom_hardware_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "configs/hardware/example.toml", "--json"], capsys)
    assert code == 0 and json.loads(out)["hardware"] == "h100-nvl"
    based = tmp_path / "fast.toml"
    based.write_text('[hardware]\nbase = "h100"\nname = "h100-2x"\npeak_bf16_flops = 1978.8e12\n')
    _, fast, _ = run([*JOB_8B, "--world-size", "8", "--hardware", str(based), "--json"], capsys)
    _, slow, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "h100", "--json"], capsys)
    assert json.loads(fast)["tps_per_device"] > 1.3 * json.loads(slow)["tps_per_device"]
    bad = tmp_path / "bad.toml"
    bad.write_text('[hardware]\nbase = "h100"\nwarp_speed = 9\n')
    code, _, err = run([*JOB_8B, "--world-size", "8", "--hardware", str(bad)], capsys)
    assert code == 2 and "unknown key 'warp_speed'" in err


def test_article_and_search_commands(capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.plan.accuracy import published

    code, out, _ = run(["--article", "--json"], capsys)
    article = json.loads(out)
    assert code == 0 and len(article["rows"]) == len(published.RUNS)
    assert article["summary"]["tps_median"] <= 0.15 and article["fit"]["constants"]
    code, out, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "h100-96gb", "--search", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["config_layout"]["layout"].startswith("FSDP 8")
    assert data["runner_up"] is not None and data["best_per_tp"]
    assert data["tps_low"] < data["tps_per_device"] < data["tps_high"]
    assert data["memory_low"] < data["peak_memory_gib"] < data["memory_high"]
    assert data["memory_verdict"] in ("fits", "tight") and isinstance(data["separable"], bool)
    assert {
        "feature": "async TP",
        "reason": "no overlap credited to meshforge's async TP until a GPU run confirms it",
    } in (data["not_searched"])


def test_cpu_preset_runs_a_probe(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--world-size", "2", "--hardware", "cpu", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["hardware"] == "cpu" and data["tps_per_device"] > 0 and data["fits"]


def test_timeline_shows_the_simulated_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """--timeline draws every pipeline rank's simulated step: GPipe's forwards all precede its backwards, and the
    last rank waits at the start for the pipeline to fill."""
    job = [*JOB_8B, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "4"]
    job += ["--parallelism.pipeline_parallel_schedule", "GPipe", "--world-size", "4", "--hardware", "h100"]
    code, out, _ = run([*job, "--timeline"], capsys)
    assert code == 0
    rows = [line.split("|")[1] for line in out.splitlines() if line.strip().startswith("rank ")]
    assert len(rows) == 4 and all(len(row) == 100 for row in rows)
    for row in rows:
        assert row.rindex("F") < row.index("B")
    assert rows[3].startswith("....") and rows[0].startswith("F")
    code, out, _ = run([*job, "--timeline", "--json"], capsys)
    data = json.loads(out)
    actions = data["timeline"]
    assert len(actions) == 4 * 8 * 2  # every rank: a forward and a backward per microbatch
    parts = data["breakdown"]["step_time_s"]
    pipeline = sum(parts[k] for k in ("compute", "exposed_tp_comm", "exposed_cp_comm", "exposed_pp_comm"))
    assert max(a["end_s"] for a in actions) == pytest.approx(pipeline + parts["pipeline_bubble"], abs=1e-4)


def test_every_prediction_carries_an_interval_and_a_three_way_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    """8B FSDP 8 at batch 2 is predicted near an 80 GB H100's capacity: 'tight' with the margin, not a yes or a no;
    on 128 GPUs of 96 GB (less state per GPU) it fits. The constants' covariance widens the interval beyond the
    leave-one-out spread, on the reference family most for a layout that leans on the least certain constant (eager
    element-wise kernels: memory_bandwidth, log standard error 0.38) and least for a compiled one."""
    code, out, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "h100", "--json"], capsys)
    near = json.loads(out)
    assert code == 0 and near["memory_low"] < near["peak_memory_gib"] < near["memory_high"]
    assert near["memory_low"] < near["capacity_gib"] < near["memory_high"] and near["memory_verdict"] == "tight"
    code, out, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "h100"], capsys)
    assert "tight (margin " in out and "interval (+-1 sd" in out  # the point estimate sits at the capacity
    code, out, _ = run([*JOB_8B, "--world-size", "128", "--hardware", "h100-96gb", "--json"], capsys)
    assert json.loads(out)["memory_verdict"] == "fits"
    spread = 2 * load_hardware("h100-96gb").efficiency.tps_log_sd
    code, out, _ = run([*JOB_8B, "--world-size", "8", "--hardware", "h100-96gb", "--json"], capsys)
    near = json.loads(out)
    code, out, _ = run([*JOB_8B, "--compile.enable", "--world-size", "8", "--hardware", "h100-96gb", "--json"], capsys)
    fused = json.loads(out)
    eager_width, fused_width = (
        math.log(near["tps_high"] / near["tps_low"]),
        math.log(fused["tps_high"] / fused["tps_low"]),
    )
    assert eager_width > fused_width > spread
