"""plan/physics/fault_tolerance.py on cases with answers worked out by hand: the Llama 3 failure rate, the lost work per
failure of checkpoint-restart and of live recovery, goodput, Young / Daly's interval, and the step-time terms."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from meshforge.errors import ConfigError
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout
from meshforge.plan.physics import comm
from meshforge.plan.physics import fault_tolerance as ft
from meshforge.plan.physics.estimate import estimate


def test_llama3_failure_rate() -> None:
    # 54 days x 24 h x 16,384 GPUs / 419 interruptions = 50,677.0 GPU-hours; on 16,384 GPUs one every 3.09 h
    assert abs(ft.MTBF_GPU_HOURS - 50_677.0) < 0.01
    f = ft.Failures()
    assert f.cluster_mtbf_s(16_384) / 3600 == pytest.approx(54 * 24 / 419)
    assert f.cluster_mtbf_s(1) == pytest.approx(50_677.0 * 3600, rel=1e-6)


def test_lost_work_per_failure() -> None:
    f = ft.Failures(checkpoint_interval_s=3600, restart_s=600, detect_restart_s=100, detect_live_s=2)
    assert ft.lost_checkpoint_restart(f) == 100 + 1800 + 600  # detect + half the interval + restart
    assert ft.lost_live(f, groups=4, step_s=2.0, recover_s=1.0) == 2 + 2 + 1 + 600 / 4  # only 1 of 4 groups waits


def test_goodput_and_the_best_interval() -> None:
    f = ft.Failures(checkpoint_interval_s=90, checkpoint_save_s=10)
    assert ft.goodput(360, 3600, f) == pytest.approx(0.9 * 0.9)  # 10 % lost to failures, 10 % to saves
    assert ft.goodput(7200, 3600, f) == 0.0  # failures faster than the work they lose: nothing gets done
    assert ft.best_interval_s(10, 18_000) == pytest.approx(600)  # sqrt(2 x 10 x 18,000)
    waste = [10 / tau + tau / (2 * 18_000) for tau in range(100, 3000)]  # saves + half an interval per failure
    assert 100 + waste.index(min(waste)) == 600


def layout(**kw: int) -> Layout:
    base = {"flavor": "8B", "seq_len": 8192, "local_batch_size": 1, "dp_replicate": 8, "dp_shard": 8}
    return Layout(**{**base, **kw})  # type: ignore[arg-type]


def test_step_cost_terms() -> None:
    hw = load_hardware("h100")
    lay = layout()
    cost, group = ft.step_cost(lay, hw, quorum_s=0.0)
    plain, alone = estimate(lay, hw), estimate(replace(lay, dp_replicate=1), hw)
    assert cost.plain_s == plain.step_time and group.step_time == alone.step_time
    link = comm.axis_link(lay, ("dp_replicate",), hw)
    grad = alone.memory.parameters * 2**30  # fp32 gradient shards: as many bytes as the fp32 parameter shards
    ring = 2 * (7 / 8 * grad / link.bandwidth + 7 * link.latency)  # 8 groups, across nodes (64 GPUs > 8 per node)
    assert not link.intra_node and cost.allreduce_s == pytest.approx(ring)
    swapped = plain.step_time - plain.time["exposed_fsdp_comm"] + alone.time["exposed_fsdp_comm"]
    assert cost.ft_s == pytest.approx(swapped + ring)
    assert ft.step_cost(lay, hw, quorum_s=0.05)[0].ft_s == pytest.approx(cost.ft_s + 0.05)
    with pytest.raises(ConfigError, match="data_parallel_replicate_degree"):
        ft.step_cost(layout(dp_replicate=1, dp_shard=64), hw)


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "meshforge", "plan", "--hardware", "h100", "--model.flavor", "8B"]
    cmd += ["--training.seq_len", "8192", "--training.local_batch_size", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_plan_prints_the_section() -> None:
    layout_flags = ["--parallelism.data_parallel_replicate_degree", "8", "--parallelism.data_parallel_shard_degree"]
    proc = plan("--world-size", "64", *layout_flags, "8", "--fault-tolerance", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)["fault_tolerance"]
    f = out["assumptions"]
    assert f["detect_restart_s"] == 100 and f["restart_s"] == 600  # comm.train_timeout_seconds, the flag's default
    assert out["lost_per_failure_checkpoint_restart_s"] == pytest.approx(100 + f["checkpoint_interval_s"] / 2 + 600)
    assert out["cluster_mtbf_s"] == pytest.approx(ft.MTBF_GPU_HOURS * 3600 / 64)
    assert math.isclose(out["goodput_live"], ft.goodput(out["lost_per_failure_live_s"], out["cluster_mtbf_s"],
                        ft.Failures(**f)))  # fmt: skip
    text = plan("--world-size", "64", *layout_flags, "8", "--fault-tolerance", "--ft-restart-seconds", "300")
    assert "live recovery" in text.stdout and "restart 300" in text.stdout, text.stdout + text.stderr
    refused = plan("--world-size", "64", "--fault-tolerance")
    assert refused.returncode == 2 and "data_parallel_replicate_degree" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
