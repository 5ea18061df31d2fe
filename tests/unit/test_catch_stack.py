"""A stack profile measured on part of a node (issue 43 item 8: a case no test built). The shipped stacks and the
tests' runs fill a whole 8-GPU node, where "within one node" and "exactly one node" agree; runs on 2 and 4 GPUs of
an H100 node are still one node: no inter-node constant is fitted, a plan on the rest of that node is within what
the runs measured (the profile's own spread), and one on two nodes is past it (at least the split's spread), in the
fit, the interval, the plan's note, the --calibrate report and the guide."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshforge.config.io import load_config
from meshforge.plan import report, shipped
from meshforge.plan.accuracy import interval, stack_fit
from meshforge.plan.guide import cli as guide_cli
from meshforge.plan.hardware import HardwareProfile, load_hardware
from meshforge.plan.layout import Layout, layout_from_config
from meshforge.plan.physics.estimate import estimate

BASE = "--model.flavor 1B --training.seq_len 4096 --training.local_batch_size 2 --activation_checkpoint.mode full"
RUNS = [(2, ""), (4, ""), (4, " --parallelism.tensor_parallel_degree 2")]


def layout(world: int, extra: str = "") -> Layout:
    return layout_from_config(load_config(None, (BASE + extra).split()), world)


def part_of_a_node(tmp_path: Path) -> tuple[HardwareProfile, stack_fit.StackFit]:
    """Three runs on 2 and 4 of an H100 node's 8 GPUs, from a stack 1.2x TorchTitan's compute."""
    hw = load_hardware("h100")
    eff = hw.efficiency
    truth = replace(hw, efficiency=replace(eff, matmul=eff.matmul * 1.2, attention=eff.attention * 1.2))
    runs = tmp_path / "runs.toml"
    runs.write_text(
        "".join(
            f'[[run]]\nname = "r{i}"\nworld_size = {w}\nargs = "{BASE + x}"\n'
            f"tokens_per_s_per_device = {estimate(layout(w, x), truth).tps_per_device:.1f}\n\n"
            for i, (w, x) in enumerate(RUNS)
        )
    )
    obs, sources = stack_fit.read_runs(runs, hw)
    return hw, stack_fit.fit_stack(obs, hw, "part", sources)


def test_runs_on_part_of_a_node_are_one_node(tmp_path: Path) -> None:
    hw, result = part_of_a_node(tmp_path)
    info, eff = result.profile.stack, result.profile.efficiency
    assert hw.spec.devices_per_node == 8 and info is not None and info.world_sizes == (2, 4)
    assert "compute" in result.fitted and "network" in result.held and eff.network == hw.efficiency.network
    assert eff.matmul == pytest.approx(1.2 * hw.efficiency.matmul, rel=0.05)  # the prior pulls it 2.5 % short
    assert stack_fit.one_node(info, hw) and not stack_fit.spans_nodes([], hw)
    text = report.format_stack_fit(result, hw)
    assert "runs on one node (<= 8 GPUs): no inter-node constant is identified" in text


def test_the_rest_of_the_node_is_within_the_runs_and_two_nodes_past_them(tmp_path: Path) -> None:
    """8 GPUs (one node, as the runs): the profile's own spread and no note; 16 GPUs (two nodes): past the runs, the
    spread at least shipped.SPLIT_LOG_SD, and the plan and the guide say the one-node runs never measured it."""
    _, result = part_of_a_node(tmp_path)
    profile = result.profile
    own = profile.efficiency.tps_log_sd
    node, two = layout(8), layout(16)
    assert not interval.past_runs(node, profile) and interval.past_runs(two, profile)
    assert interval.tps_spread(node, profile) == (own, f"the profile's spread {own:.3f}")
    assert interval.tps_spread(two, profile)[0] == max(own, shipped.SPLIT_LOG_SD)
    assert "span" not in report.stack_note(estimate(node, profile), profile)
    note = report.stack_note(estimate(two, profile), profile)
    assert "16 GPUs span 2 nodes, which its one-node runs never measured" in note
    guide = guide_cli.stack_note(profile, [8, 16])
    assert "Its runs fit in one node (8 GPUs): the cells at 16 GPUs use h100's" in guide
