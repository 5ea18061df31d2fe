"""The bench's "HSDP + fault tolerance" row (bench/ft_rows.py): a [[run]] with ``fault_tolerance = true`` starts a
Lighthouse and dp_replicate torchft groups through `meshforge train --nproc N --fault_tolerance.local_replicas R`,
its metrics are the groups' combined, and the report sets it beside plain HSDP of the same shape."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.bench import ft_rows
from meshforge.bench.matrix import parse_matrix
from meshforge.bench.runner import Launch, command, hardware_refusal, layout_refusal

MATRIX = """
[bench]
name = "ft-test"
flavor = "tiny"
seq_len = 64
global_batch_size = 8
warmup_steps = 1
measured_steps = 2
repeat = 1
timeout_s = 200
baseline = "hsdp"
parity_rtol = 1e-4

[bench.overrides]
"training.deterministic" = true
"metrics.straggler_threshold" = 0

[[run]]
name = "hsdp"
ranks = 4
dp_replicate = 2
dp_shard = 2

[[run]]
name = "hsdp_ft"
ranks = 4
dp_replicate = 2
dp_shard = 2
fault_tolerance = true
"""
HEAD = {"name": "m", "flavor": "tiny", "seq_len": 64, "global_batch_size": 8, "warmup_steps": 1, "measured_steps": 2}


@pytest.mark.distributed
@pytest.mark.slow
def test_fault_tolerant_row_runs_and_reports_its_cost(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")
    matrix, out = tmp_path / "ft.toml", tmp_path / "out"
    matrix.write_text(MATRIX)
    cmd = [sys.executable, "-m", "meshforge", "bench", "--config", str(matrix), "--out", str(out), "--hardware", "none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    ft, plain = runs["hsdp_ft"], runs["hsdp"]
    assert ft["status"] == "ok" and ft["flags"]["fault_tolerance"] and not plain["flags"]["fault_tolerance"], ft
    assert "--fault_tolerance.local_replicas 2" in " ".join(ft["command"]) and "--nproc" in ft["command"]
    groups = [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in ft_rows.metrics_files(out / "runs" / "hsdp_ft" / "rep0", 2)
    ]
    assert all(len(g) == 3 for g in groups)  # both groups trained every step
    steps = list(zip(*groups, strict=True))
    assert ft["loss_curve"] == [[a["step"], statistics.fmean([a["loss"], b["loss"]])] for a, b in steps]
    assert ft["tps_steps"] == [[statistics.fmean([a["tps"], b["tps"]]) for a, b in steps[1:]]]
    assert ft["parity"]["ok"] and ft["parity"]["max_rel_diff"] <= 1e-4, ft["parity"]  # the same training as HSDP
    report = (out / "report.md").read_text()
    cost = report.split("### Fault tolerance cost", 1)[1].split("\n\n", 2)[1]  # the cost table
    row = next(line for line in cost.splitlines() if line.startswith("| replicate (torchft groups) 2 x shard 2 (`"))
    assert "| `hsdp` |" in row and f"{ft['tps_per_device']:,.1f}" in row and f"{plain['tps_per_device']:,.1f}" in row
    ratio = ft["tps_per_device"] / plain["tps_per_device"]
    assert f"{ratio:.2f}x (" in row, (ratio, row)


def test_groups_metrics_combine_step_by_step() -> None:
    a = [
        {"step": 1, "loss": 2.0, "tps": 10.0, "step_time_s": 1.0, "peak_memory_gib": 0.5, "elapsed_s": 1.0},
        {"step": 2, "loss": 1.0, "tps": 30.0, "step_time_s": 0.5, "peak_memory_gib": 0.5, "elapsed_s": 1.5},
    ]
    b = [{"step": 1, "loss": 4.0, "tps": 20.0, "step_time_s": 2.0, "peak_memory_gib": 0.25, "elapsed_s": 2.0}]
    merged = ft_rows.merge([a, b])  # fmt: skip
    assert merged == [
        {"step": 1, "loss": 3.0, "tps": 15.0, "step_time_s": 2.0, "peak_memory_gib": 0.5, "elapsed_s": 2.0,
         "replica_groups": 2}
    ]  # fmt: skip
    assert ft_rows.merge([a, []]) == []  # a group that logged nothing: the repetition did not finish


def test_fault_tolerant_row_needs_replica_groups_and_one_node() -> None:
    with pytest.raises(ValueError, match="needs dp_replicate >= 2"):
        parse_matrix({"bench": HEAD, "run": [{"name": "a", "ranks": 4, "fault_tolerance": True}]})
    entry = {"name": "a", "ranks": 4, "dp_replicate": 2, "fault_tolerance": True}
    matrix = parse_matrix({"bench": HEAD, "run": [entry]})
    run = matrix.runs[0]
    args = matrix.train_args(run, "d")
    assert args[args.index("--parallelism.data_parallel_replicate_degree") + 1] == "1"  # the layout of one group
    assert args[args.index("--parallelism.data_parallel_shard_degree") + 1] == "-1"
    assert matrix.local_batch_size(run) == 2  # 8 sequences over 2 groups x FSDP 2: the same as HSDP 2 x 2
    cmd = command(matrix, run, "d", Launch())
    assert cmd[1:6] == ["-m", "meshforge", "train", "--nproc", "4"] and "--fault_tolerance.enable" in cmd
    assert layout_refusal(matrix, run) == ""  # checked as one group of 2 ranks, not as 4
    many = Launch(nnodes=2, nproc_per_node=2, rdzv_endpoint="h:1")
    assert "on one node" in hardware_refusal(run, many)


def test_cost_table_sets_each_fault_tolerant_row_beside_its_plain_twin() -> None:
    layout = {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1, "schedule": None}
    shape = {"world_size": 4, "layout": layout, "seq_len": 64, "global_batch_size": 8, "status": "ok"}
    other = {**shape, "layout": {**layout, "dp_replicate": 1, "dp_shard": 4}}
    runs = [
        {**other, "name": "fsdp", "flags": {}, "tps_per_device": 300.0, "step_time_s": 1.0, "tps_steps": [[300.0] * 4]},
        {**shape, "name": "hsdp", "flags": {}, "tps_per_device": 200.0, "step_time_s": 2.0,
         "tps_steps": [[190.0, 200.0, 210.0, 200.0]]},
        {**shape, "name": "ft", "label": "FT", "flags": {"fault_tolerance": True}, "tps_per_device": 150.0,
         "step_time_s": 2.5, "tps_steps": [[140.0, 150.0, 160.0, 150.0]]},
    ]  # fmt: skip
    lines = ft_rows.cost_lines({"bench": {"confidence": 0.95}, "runs": runs})
    row = next(line for line in lines if line.startswith("| FT (`ft`)"))
    assert "| `hsdp` | 150.0 | 200.0 | 0.75x (" in row and "| 2.500 | 2.000 | ok |" in row, row
    assert ft_rows.cost_lines({"bench": {}, "runs": runs[:2]}) == []  # no fault-tolerant row: no section
