"""Calibration: a bench results.json made by the model itself with perturbed constants is fitted back to them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from meshforge.cli import main
from meshforge.model.flavors import get_flavor
from meshforge.plan.accuracy import stack
from meshforge.plan.hardware import CPU_EFFICIENCY, HardwareProfile, HardwareSpec, save_profile
from meshforge.plan.layout import Layout, with_stages
from meshforge.plan.physics.estimate import estimate

SPEC = HardwareSpec(
    name="cpu-fixed",
    description="a fixed CPU-like host for tests",
    peak_bf16_flops=2e11,
    peak_fp32_flops=8e10,
    peak_fp8_flops=0.0,
    memory_gib=16.0,
    memory_bandwidth=8e9,
    intra_node_bandwidth=1e9,
    intra_node_latency=1e-4,
    inter_node_bandwidth=1e9,
    inter_node_latency=1e-4,
    devices_per_node=1024,
    runtime_gib=0.0,
    node_cores=2,
    probe_threads=1,
    comm_overlaps_compute=False,
    is_gpu=False,
    stage_overhead=1e-3,
)
RUNS = [  # name, ranks, dp_shard, tp, pp, cp, schedule, compile, seq, global batch, flavor
    ("single", 1, 1, 1, 1, 1, "1F1B", False, 128, 4, "debugmodel"),
    ("fsdp2", 2, 2, 1, 1, 1, "1F1B", False, 128, 4, "debugmodel"),
    ("fsdp4", 4, 4, 1, 1, 1, "1F1B", False, 128, 4, "debugmodel"),
    ("fsdp4_compile", 4, 4, 1, 1, 1, "1F1B", True, 128, 4, "debugmodel"),
    ("tp4", 4, 1, 4, 1, 1, "1F1B", False, 128, 4, "debugmodel"),
    ("fsdp_tp", 4, 2, 2, 1, 1, "1F1B", False, 128, 4, "debugmodel"),
    ("pp4", 4, 1, 1, 4, 1, "1F1B", False, 128, 4, "debugmodel"),
    ("pp4_interleaved", 4, 1, 1, 4, 1, "Interleaved1F1B", False, 128, 4, "debugmodel"),
    ("cp2", 4, 2, 1, 1, 2, "1F1B", False, 256, 4, "debugmodel"),
    ("tiny_fsdp2", 2, 2, 1, 1, 1, "1F1B", False, 512, 8, "tiny"),
    ("tiny_single", 1, 1, 1, 1, 1, "1F1B", False, 512, 8, "tiny"),
]
TRUTH = {"matmul": 0.5, "memory_bandwidth": 0.9, "network": 0.3, "intra_node_latency": 4e-4, "stage_overhead": 2.5e-3}


def record(run: tuple[Any, ...], hw: HardwareProfile) -> dict[str, Any]:
    name, ranks, shard, tp, pp, cp, schedule, compile_, seq, global_batch, flavor = run
    dp = shard
    layout = with_stages(
        Layout(
            flavor=flavor,
            seq_len=seq,
            local_batch_size=global_batch // dp,
            dp_shard=shard,
            tp=tp,
            pp=pp,
            cp=cp,
            schedule=schedule,
            compile=compile_,
            ac_mode="none",
            param_dtype="float32",
            reshard_after_forward=pp == 1,
            threads_per_rank=1,
        ),
        get_flavor(flavor),
    )
    est = estimate(layout, hw)
    return {
        "name": name,
        "status": "ok",
        "flavor": flavor,
        "seq_len": seq,
        "local_batch_size": global_batch // dp,
        "world_size": ranks,
        "dtype": "float32",
        "threads_per_rank": 1,
        "layout": {
            "dp_replicate": 1,
            "dp_shard": shard,
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "schedule": schedule if pp > 1 else None,
        },
        "flags": {
            "compile": compile_,
            "float8": False,
            "ac_mode": "none",
            "async_tp": False,
            "param_dtype": "float32",
            "microbatch_size": 1,
        },
        "tps_per_device": est.tps_per_device,
        "peak_memory_gib": est.peak_memory_gib,
    }


def test_calibration_recovers_perturbed_constants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = HardwareProfile(SPEC, CPU_EFFICIENCY)
    truth = HardwareProfile(
        replace(SPEC, intra_node_latency=TRUTH["intra_node_latency"], stage_overhead=TRUTH["stage_overhead"]),
        replace(
            CPU_EFFICIENCY,
            matmul=TRUTH["matmul"],
            memory_bandwidth=TRUTH["memory_bandwidth"],
            network=TRUTH["network"],
            allocator_overhead=0.2,
            framework_gib=0.5,
        ),
    )
    records = [record(run, truth) for run in RUNS]
    records.append({**records[0], "name": "broken", "status": "failed", "tps_per_device": None})
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"records": records}))
    hw_file = tmp_path / "cpu-fixed.toml"
    save_profile(start, hw_file)

    assert main(["plan", "--calibrate", str(results), "--hardware", str(hw_file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fitted = stack.load_profile(out["profile"])  # a stack profile: the CPU spec and its fitted constants
    for key in ("matmul", "memory_bandwidth", "network"):
        assert getattr(fitted.efficiency, key) == pytest.approx(TRUTH[key], rel=0.03), key
    # the pull toward the start (calibrate.PRIOR_WEIGHT) shows on the two constants these runs pin down least
    for key in ("intra_node_latency", "stage_overhead"):
        assert getattr(fitted.spec, key) == pytest.approx(TRUTH[key], rel=0.06), key
    assert fitted.efficiency.framework_gib == pytest.approx(0.5, abs=0.02)
    assert fitted.efficiency.allocator_overhead == pytest.approx(0.2, abs=0.02)
    assert len(out["runs"]) == len(RUNS)  # the failed run is skipped
    assert max(abs(r["tps_error"]) for r in out["runs"]) < 0.01
    assert max(abs(r["memory_error"]) for r in out["runs"]) < 0.01
    assert max(abs(r["tps_error"]) for r in out["runs_before_fit"]) > 0.2  # the start was really off


def test_calibration_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hw = HardwareProfile(SPEC, CPU_EFFICIENCY)
    results = tmp_path / "results.json"
    results.write_text(json.dumps([record(run, hw) for run in RUNS[:4]]))
    hw_file = tmp_path / "cpu.toml"
    save_profile(hw, hw_file)
    out_file = tmp_path / "fitted.toml"
    assert main(["plan", "--calibrate", str(results), "--hardware", str(hw_file), "--out", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert str(out_file) in text and "| fsdp4 |" in text and out_file.is_file()


def test_cpu_time_sharing_counts_busy_ranks_and_scheduler_latency() -> None:
    """Pipeline ranks waiting for inputs lend their cores; a CPU collective pays log2(n) scheduler waits, each the
    longer the more ranks share a core."""
    from meshforge.parallel.pipeline.simulator import simulate
    from meshforge.plan.physics import comm
    from meshforge.plan.physics.estimate import pipeline_step, rates, stage_costs

    assert SPEC.oversubscription(4, 1) == 2.0
    assert SPEC.oversubscription(4, 1, busy=0.5) == 1.0  # half the ranks runnable fill the 2 cores exactly
    assert replace(SPEC, node_cores=0).oversubscription(8, 1, busy=0.5) == 1.0  # GPUs: never time-shared
    cpu_link = comm.Link(1e9, 1e-3, True, log_steps=True)
    gpu_link = comm.Link(1e9, 1e-3, True)
    assert comm.all_gather(8.0, 8, cpu_link) == pytest.approx(7e-9 + 3e-3)
    assert comm.all_gather(8.0, 8, gpu_link) == pytest.approx(7e-9 + 7e-3)
    assert comm.p2p(8.0, cpu_link) == pytest.approx(8e-9)  # a send's host work is the pipeline's stage_overhead
    hw = HardwareProfile(SPEC, CPU_EFFICIENCY)
    args = get_flavor("debugmodel").with_seq_len(128)

    def job(**degrees: int) -> Layout:
        base = Layout(flavor="debugmodel", seq_len=128, local_batch_size=4, param_dtype="float32", threads_per_rank=1)
        return with_stages(replace(base, **degrees), args)

    fsdp2, fsdp8 = job(dp_shard=2), job(dp_shard=8)
    assert comm.axis_link(fsdp8, ("dp_shard",), hw).latency == 4 * comm.axis_link(fsdp2, ("dp_shard",), hw).latency
    pp = job(pp=4)
    r = rates(pp, hw)
    send = comm.p2p(128 * args.dim * 4, comm.axis_link(pp, ("pp",), hw))  # one microbatch's fp32 activations
    alone = simulate(pp, stage_costs(args, pp, hw, r, 1.0), send, SPEC.stage_overhead)
    share = alone.mean_busy / alone.makespan
    assert 0.4 < share < 0.7  # 1F1B, 4 microbatches on 4 stages: about 4/7 of the step busy
    over, sim = pipeline_step(args, pp, hw, r)
    assert over == pytest.approx(4 * share / 2)
    est = estimate(pp, hw)
    assert est.step_time == pytest.approx(sum(est.time.values()))
    assert est.time["compute"] + est.time["pipeline_bubble"] + est.time["exposed_pp_comm"] == pytest.approx(
        sim.makespan
    )
