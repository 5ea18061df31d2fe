"""`meshforge bench` end to end on a tiny matrix, plus the matrix, error and report logic without processes."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.bench.machine import noise_warnings
from meshforge.bench.matrix import load_matrix, parse_matrix
from meshforge.bench.report import attach_parity, render_report
from meshforge.bench.runner import classify, error_line
from meshforge.model.flavors import MFU_CAUSAL_LABEL, MFU_LABEL

RECORD_KEYS = {
    "name", "label", "group", "layout", "flags", "flavor", "dtype", "seq_len", "global_batch_size", "local_batch_size",
    "gradient_accumulation_steps", "world_size", "steps", "warmup_steps", "measured_steps", "tps_per_device",
    "tps_per_device_iqr", "tps_per_device_min", "tps_per_device_max", "job_tps", "tflops", "mfu_pct", "mfu_causal_pct",
    "peak_memory_gib", "final_loss", "loss_curve", "bubble_pct", "wall_s", "startup_s", "status", "error", "parity",
    "command", "fingerprint",
}  # fmt: skip
LAYOUT_KEYS = {"dp_replicate", "dp_shard", "tp", "pp", "cp", "schedule"}
FLAG_KEYS = {"compile", "float8", "ac_mode", "async_tp"}

TINY = """
[bench]
name = "tiny-test"
description = "two FSDP sizes and a layout this model cannot take"
flavor = "tiny"
seq_len = 64
global_batch_size = 4
warmup_steps = 1
measured_steps = 2
timeout_s = 120
baseline = "fsdp"
parity_rtol = 1e-5

[bench.overrides]
"training.deterministic" = true
"optimizer.lr" = 3e-3

[[run]]
name = "fsdp"
ranks = 2

[[run]]
name = "tp_bad"
ranks = 4
tp = 4

[[scaling]]
run = "fsdp"
ranks = [1, 2]
"""


def bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "meshforge", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_tiny_matrix_end_to_end(tmp_path: Path) -> None:
    matrix, out = tmp_path / "tiny.toml", tmp_path / "out"
    matrix.write_text(TINY)
    proc = bench("--config", str(matrix), "--out", str(out), "--repeat", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # e.g. runpy's about the warm launcher's module
    assert "3 runs to go" in proc.stdout and " ok fsdp " in proc.stdout  # the progress display's lines
    done = [line.split()[1] + line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("  ok ")]
    assert done == ["fsdp[1/2]", "fsdp_r1[1/2]", "fsdp[2/2]", "fsdp_r1[2/2]"], done  # interleaved: AB AB

    results = json.loads((out / "results.json").read_text())
    assert {"schema_version", "bench", "machine", "sweep", "runs"} <= set(results)
    runs = {r["name"]: r for r in results["runs"]}
    assert list(runs) == ["fsdp", "tp_bad", "fsdp_r1"]
    for record in runs.values():
        assert set(record) >= RECORD_KEYS, RECORD_KEYS - set(record)
        assert set(record["layout"]) == LAYOUT_KEYS and set(record["flags"]) >= FLAG_KEYS
    check_ok_runs(runs, out)
    bad = runs["tp_bad"]
    assert bad["status"] == "unsupported" and "tensor_parallel_degree = 4" in bad["error"], bad["error"]
    check_report(results, (out / "report.md").read_text())
    for name in ("throughput", "scaling", "memory", "loss", "prediction"):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name

    # Resume: finished runs are reused; --force --only reruns just the named one.
    again = bench("--config", str(matrix), "--out", str(out), "--force", "--only", "tp_bad", "--repeat", "2")
    assert again.returncode == 0 and "1 runs to go, 2 reused" in again.stdout, again.stdout + again.stderr
    rerun = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert list(rerun) == list(runs) and rerun["fsdp"]["finished_at"] == runs["fsdp"]["finished_at"]
    assert rerun["fsdp_r1"]["tps_per_device"] == runs["fsdp_r1"]["tps_per_device"]


def check_ok_runs(runs: dict[str, dict], out: Path) -> None:
    """Figures are medians over the measured steps of both repetitions' own metrics.jsonl, with an interval that
    holds the median; both repetitions train the same losses."""
    for name in ("fsdp", "fsdp_r1"):
        record = runs[name]
        assert record["status"] == "ok" and record["error"] == "", record["error"]
        reps = [
            [json.loads(line) for line in (out / "runs" / name / f"rep{i}" / "metrics.jsonl").read_text().splitlines()]
            for i in range(2)
        ]
        measured = [[s for s in steps if s["step"] > 1] for steps in reps]
        pooled = [s["tps"] for rep in measured for s in rep]
        assert record["tps_per_device"] == pytest.approx(statistics.median(pooled))
        assert record["tps_steps"] == [[s["tps"] for s in rep] for rep in measured]
        low, high = record["tps_per_device_ci"]
        assert low <= record["tps_per_device"] <= high and len(record["repetitions"]) == 2
        assert record["peak_memory_gib"] == max(s["peak_memory_gib"] for rep in measured for s in rep) > 0.05
        steps = reps[0]
        assert record["loss_curve"] == [[s["step"], s["loss"]] for s in steps] and len(steps) == 3
        assert [s["loss"] for s in reps[1]] == [s["loss"] for s in steps]  # deterministic: repetitions agree
        assert record["final_loss"] == steps[-1]["loss"] and record["measured_steps"] == 4
        assert record["startup_s"] > 0 and all(r["startup_s"] > 0 for r in record["repetitions"])
        assert record["global_batch_size"] == 4 and record["wall_s"] > 0
    assert runs["fsdp_r1"]["gradient_accumulation_steps"] == 2 and runs["fsdp_r1"]["local_batch_size"] == 2
    parity = runs["fsdp_r1"]["parity"]
    assert parity["reference"] == "fsdp" and parity["ok"] and parity["max_rel_diff"] <= 1e-5, parity


def check_report(results: dict, report: str) -> None:
    """Every figure of report.md is the JSON's, formatted."""
    runs = {r["name"]: r for r in results["runs"]}
    fsdp, single = runs["fsdp"], runs["fsdp_r1"]
    row = next(line for line in report.splitlines() if "(`fsdp`)" in line)
    for value in (f"{fsdp['tps_per_device']:,.1f}", f"{fsdp['peak_memory_gib']:,.3f}", f"{fsdp['final_loss']:,.4f}"):
        assert value in row, (value, row)
    efficiency = 100 * fsdp["tps_per_device"] / single["tps_per_device"]
    scaling_row = next(line for line in report.splitlines() if line.startswith("| 2 |"))
    assert f"{efficiency:.0f}%" in scaling_row and f"{fsdp['job_tps']:,.1f}" in scaling_row
    assert runs["tp_bad"]["error"].replace("|", "/") in report
    assert "One rank per core" in report or results["machine"]["device"] == "cuda"
    low, high = fsdp["tps_per_device_ci"]
    assert f"{low:,.1f}-{high:,.1f}" in row and "## Statistics per run" in report
    assert "Machine state:" in report and "repeated 2 times" in report
    assert ("Noisy sweep" in report) == bool(noise_warnings(results["machine"], results["sweep"], results["runs"]))


def test_list_prints_commands_and_article_figures() -> None:
    proc = bench("--config", "configs/bench/llama3_8b_8gpu.toml", "--list", "--compare-with", "reference", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "5,762" in proc.stdout and "8,532" in proc.stdout and "Table 1: FSDP + compile + Float8" in proc.stdout
    assert proc.stdout.count("--standalone --nproc_per_node=8 -m meshforge train") == 3
    assert "--compile.enable true" in proc.stdout


def test_every_shipped_matrix_loads() -> None:
    for path in sorted(Path("configs/bench").glob("*.toml")):
        matrix = load_matrix(path)
        assert matrix.runs and (not matrix.baseline or matrix.run(matrix.baseline))
    default = load_matrix("configs/bench/default.toml")
    names = {r.name for r in default.runs}
    assert {"fsdp", "fsdp_compile", "fsdp_float8", "tp", "fsdp_tp", "pp_1f1b", "pp_interleaved", "pp_zbv"} <= names
    assert default.scaling["fsdp_scaling"][0] == "fsdp_r1" and default.scaling["fsdp_scaling"][-1] == "fsdp"
    assert default.run("fsdp").ranks == default.ranked_ranks >= 2  # tests/unit/test_bench_ranks.py: the detection
    assert len({default.global_batch_of(r) for r in default.runs}) == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"tp": 3}, "must equal ranks = 4"),
        ({"colour": 1}, "unknown key run[0].colour"),
        ({"ranks": "4"}, "run[0].ranks = '4' must be int"),
        ({"reference": "table9"}, "not one of the article's figures"),
    ],
)
def test_matrix_mistakes_name_the_key(edit: dict, message: str) -> None:
    tree = {
        "bench": {"name": "m", "flavor": "tiny", "seq_len": 64, "global_batch_size": 4, "warmup_steps": 1,
                  "measured_steps": 2},
        "run": [{"name": "a", "ranks": 4, **edit}],
    }  # fmt: skip
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_matrix(tree)


def test_failure_reason_is_the_root_error(tmp_path: Path) -> None:
    stderr = (
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File x.py\n"
        "[rank1]: RuntimeError: Connection closed by peer\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert error_line(stderr) == "RuntimeError: Connection closed by peer"
    own = "noise\nmeshforge train: error: async TP needs CUDA symmetric memory\nValueError: other\n"
    assert error_line(own) == "meshforge train: error: async TP needs CUDA symmetric memory"
    logs = (tmp_path / "out.log", tmp_path / "err.log")
    logs[0].write_text("")
    logs[1].write_text(own)
    assert classify(1, False, 60, logs, [], 6)[0] == "unsupported"
    logs[1].write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n")
    status, error = classify(1, False, 60, logs, [], 6)
    assert status == "failed" and error.startswith("OOM: torch.OutOfMemoryError")
    assert classify(None, True, 60, logs, [{}], 6) == ("failed", "timeout: no result within 60 s (1 of 6 steps logged)")


def test_parity_flags_a_diverging_run() -> None:
    base = {"status": "ok", "seq_len": 64, "global_batch_size": 4, "steps": 2, "dtype": "float32", "group": "strategy"}
    runs = [
        {**base, "name": "fsdp", "flags": {"compile": False, "float8": False}, "loss_curve": [[1, 8.0], [2, 7.0]]},
        {**base, "name": "odd", "flags": {"compile": True, "float8": False}, "loss_curve": [[1, 8.0], [2, 7.01]]},
    ]
    results = {"bench": {"baseline": "fsdp", "parity_rtol": 1e-4}, "runs": runs}
    attach_parity(results, {})
    assert runs[0]["parity"]["ok"] and not runs[1]["parity"]["ok"]
    assert runs[1]["parity"]["max_rel_diff"] == pytest.approx(0.01 / 7.0)


def test_report_renders_without_any_successful_run() -> None:
    record = {
        "name": "a", "label": "FSDP 2", "group": "strategy", "layout": {"pp": 1, "cp": 1}, "world_size": 2,
        "status": "failed", "error": "boom", "seq_len": 64, "reference": "", "parity": None,
        **dict.fromkeys(("tps_per_device", "tps_per_device_iqr", "job_tps", "tflops", "mfu_pct", "peak_memory_gib",
                         "final_loss", "wall_s", "startup_s", "step_time_s", "bubble_pct")),
    }  # fmt: skip
    results = {
        "bench": {"name": "m", "source": "", "description": "", "flavor": "tiny", "dtype": "float32", "seq_len": 64,
                  "global_batch_size": 4, "warmup_steps": 1, "measured_steps": 2, "baseline": "a", "scaling": {}},
        "machine": {"device": "cpu", "cpu": "x", "cpu_cores": 2, "torch": "2", "load_avg_1m_before": 0.1},
        "runs": [record],
    }  # fmt: skip
    text = render_report(results, compare_with="reference")
    assert "No strategy finished" in text and "| `a` | failed | boom |" in text
    # both MFU conventions, labelled (issue 46.5); a record written before mfu_causal_pct existed still renders
    assert "| MFU % | MFU % causal |" in text and MFU_LABEL in text and MFU_CAUSAL_LABEL in text
