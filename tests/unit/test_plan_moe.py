"""Planner terms of MoE under expert parallel: expert memory per rank, all-to-all intra vs inter node, headroom."""

from __future__ import annotations

import pytest

from meshforge.model.flavors import get_flavor, param_counts
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout
from meshforge.plan.physics.moe import all_to_all, expert_link, moe_estimate

ARGS = get_flavor("deepseek_v3_671B")
HW = load_hardware("h100")


def layout(**kw: int) -> Layout:
    return Layout(flavor="deepseek_v3_671B", seq_len=4096, local_batch_size=1, **kw)  # type: ignore[arg-type]


def test_expert_memory_is_total_over_ep_and_efsdp() -> None:
    est = moe_estimate(ARGS, layout(dp_shard=32, pp=8), ep=32, hw=HW)
    routed = 58 * 256 * 3 * 7168 * 2048  # 58 MoE layers of 256 experts
    assert est.expert_params_per_rank == routed // 32 // 8  # efsdp 1: the pipeline stage's share of its experts
    assert est.total_params == param_counts(ARGS).total > 10 * est.active_params


def test_all_to_all_crosses_nodes_beyond_a_host() -> None:
    small, big = expert_link(layout(dp_shard=8), 8, HW), expert_link(layout(dp_shard=64), 64, HW)
    assert small.intra_node and not big.intra_node
    t8 = moe_estimate(ARGS, layout(dp_shard=64), ep=8, hw=HW).all_to_all_seconds
    t64 = moe_estimate(ARGS, layout(dp_shard=64), ep=64, hw=HW).all_to_all_seconds
    assert t64 > 5 * t8  # NVLink vs the network
    assert all_to_all(1e9, 1, small) == 0.0
    assert all_to_all(1e9, 2, small) == pytest.approx(0.5e9 / small.bandwidth + small.latency)


def test_imbalance_headroom_grows_with_max_load() -> None:
    even = moe_estimate(ARGS, layout(dp_shard=32), ep=32, hw=HW, max_load=1.0)
    skewed = moe_estimate(ARGS, layout(dp_shard=32), ep=32, hw=HW, max_load=2.0)
    assert even.imbalance_headroom_bytes == 0 < skewed.imbalance_headroom_bytes
    assert skewed.all_to_all_seconds > even.all_to_all_seconds
