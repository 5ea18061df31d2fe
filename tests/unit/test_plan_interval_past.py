"""A stack profile's interval past what its runs measured (plan/accuracy/interval.py ``tps_spread``): more nodes than
its runs spanned (on a CPU host, more ranks) widen the spread to at least the measured one-node -> multi-node error
(shipped.SPLIT_LOG_SD), whatever the runs' own leave-one-out spread, and the printed label names the spread used."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from meshforge.config.io import load_config
from meshforge.plan import report, shipped
from meshforge.plan.accuracy import calibrate, interval, stack_fit
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import estimate

ROOT = Path(__file__).resolve().parents[2]
BASE = (
    "--model.flavor 8B --training.seq_len 8192 --training.local_batch_size 1 --training.gradient_accumulation_steps 32 "
    "--activation_checkpoint.mode none --compile.enable"
)
CP = BASE + " --parallelism.context_parallel_degree 2 --parallelism.fsdp_reshard_after_forward never"
RUNS = [(8, CP, 10153.0), (4, CP, 9900.0), (8, BASE + " --parallelism.data_parallel_shard_degree 8", 9800.0)]


def _stack(tmp_path: Path, runs: list[tuple[int, str, float]]) -> stack_fit.StackFit:
    body = "".join(
        f'[[run]]\nname = "r{i}"\nworld_size = {w}\nargs = "{a}"\ntokens_per_s_per_device = {t}\n\n'
        for i, (w, a, t) in enumerate(runs)
    )
    (tmp_path / "runs.toml").write_text(body)
    hw = load_hardware("h100")
    obs, sources = stack_fit.read_runs(tmp_path / "runs.toml", hw)
    return stack_fit.fit_stack(obs, hw, "s", sources)


def _half(world: int, hw: object, args: str = CP) -> tuple[float, interval.Interval, str]:
    layout = layout_from_config(load_config(None, args.split()), world)
    est = estimate(layout, hw)  # type: ignore[arg-type]
    iv = interval.interval(est, hw)  # type: ignore[arg-type]
    return math.log(iv.tps_high / est.tps_per_device), iv, report.format_estimate(est, hw, iv)  # type: ignore[arg-type]


def test_one_node_profile_is_widened_past_its_node(tmp_path: Path) -> None:
    """Three runs at 4 and 8 GPUs measure their own spread (well under SPLIT_LOG_SD): inside the node it is used; at
    128 GPUs (16 nodes) the interval is at least SPLIT_LOG_SD wide and the printed line says so."""
    profile = _stack(tmp_path, RUNS).profile
    own = profile.efficiency.tps_log_sd
    assert own < shipped.SPLIT_LOG_SD / 2  # the runs' leave-one-out spread: the case the widening is for
    half, iv, text = _half(8, profile)
    assert iv.tps_log_sd == pytest.approx(own) and half < shipped.SPLIT_LOG_SD
    assert f"the profile's spread {own:.3f}" in text
    half, iv, text = _half(128, profile)
    assert iv.tps_log_sd == pytest.approx(shipped.SPLIT_LOG_SD)
    assert half >= shipped.SPLIT_LOG_SD - 1e-9
    line = next(x for x in text.splitlines() if x.startswith("interval"))
    assert f"shipped.SPLIT_LOG_SD {shipped.SPLIT_LOG_SD:.3f}" in line
    assert f"widened from the profile's {own:.3f}" in line
    assert "past its runs on <= 8 GPUs" in line
    assert "never measured" in report.stack_note(estimate(iv_layout(128), profile), profile)


def iv_layout(world: int, args: str = CP) -> object:
    return layout_from_config(load_config(None, args.split()), world)


def test_two_node_profile_is_widened_only_past_its_nodes(tmp_path: Path) -> None:
    """Runs spanning two nodes (16 GPUs) measured two nodes: 16 GPUs is inside, 24 (three nodes) is past."""
    wide = BASE + " --parallelism.data_parallel_shard_degree 16"
    profile = _stack(tmp_path, [*RUNS, (16, wide, 9500.0)]).profile
    assert profile.efficiency.tps_log_sd < shipped.SPLIT_LOG_SD
    assert not interval.past_runs(iv_layout(16), profile)  # type: ignore[arg-type]
    assert interval.past_runs(iv_layout(24), profile)  # type: ignore[arg-type]
    assert _half(24, profile)[1].tps_log_sd == pytest.approx(shipped.SPLIT_LOG_SD)


def test_cpu_profile_past_its_ranks_says_ranks() -> None:
    """A CPU profile fitted on 1-2 ranks: 2 ranks inside, 4 past; its note counts ranks, never GPUs, and says 4 ranks
    is past what was measured."""
    hw = load_hardware("cpu")
    obs = calibrate.read_results(ROOT / "docs" / "benchmarks" / "planner-one-node" / "calibrate-1-2-ranks.json")
    profile = stack_fit.fit_stack(obs, hw, "cpu-stack").profile
    args = (
        "--model.flavor debugmodel --training.seq_len 128 --training.local_batch_size 2 "
        "--training.mixed_precision_param float32 --activation_checkpoint.mode none "
        "--parallelism.data_parallel_shard_degree 2"
    )
    inside = estimate(iv_layout(2, args), profile)  # type: ignore[arg-type]
    past = estimate(iv_layout(4, args + " --parallelism.tensor_parallel_degree 2"), profile)  # type: ignore[arg-type]
    assert not interval.past_runs(inside.layout, profile) and interval.past_runs(past.layout, profile)
    note = report.stack_note(past, profile)
    assert "from runs on 1, 2 ranks" in note and "GPUs" not in note.split("(")[0]
    assert "4 ranks is past the 2 its runs measured" in note
    iv = interval.interval(past, profile)
    assert iv.tps_log_sd >= shipped.SPLIT_LOG_SD and "past its runs on <= 2 ranks" in iv.spread
    assert "covariance" not in iv.spread  # none off GPU
