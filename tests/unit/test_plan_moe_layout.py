"""MoE in `meshforge plan`: per-rank parameters equal the dry run's, memory moves with experts and EP degree, dense
flavors stay as they were, --search tries EP degrees only for MoE flavors, bad EP degrees are one-line errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshforge.cli import main
from meshforge.config.io import ConfigError, load_config
from meshforge.model.flavors import flops_per_token, get_flavor
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout, layout_args, layout_from_config
from meshforge.plan.physics.estimate import estimate
from meshforge.plan.physics.parts import compute_view, local_param_numel, rank_parts, routed_rank_numel
from meshforge.plan.physics.peak import memory
from meshforge.plan.search import advisor
from meshforge.tools.dry_run import plan as dry_run

H100 = load_hardware("h100")
MOE = get_flavor("debugmoe")


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        (16, ["--parallelism.expert_parallel_degree", "4"]),
        (16, ["--parallelism.expert_parallel_degree", "4", "--parallelism.tensor_parallel_degree", "2"]),
        (8, ["--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]),
        (
            8,
            [
                *("--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"),
                *("--parallelism.pipeline_parallel_schedule", "GPipe"),
            ],
        ),
        (16, ["--parallelism.tensor_parallel_degree", "2"]),  # EP 1: FSDP chunks the experts' dim 0
    ],
)
def test_rank_parameters_equal_the_dry_run(world: int, overrides: list[str]) -> None:
    cfg = load_config(None, ["--model.flavor", "debugmoe", *overrides])
    layout = layout_from_config(cfg, world)
    args = layout_args(layout)
    for rank in dry_run(cfg, world).ranks:  # the real model on the meta device, sharded by the real code
        assert local_param_numel(args, layout, rank_parts(args, layout, rank.pp_rank)) == rank.param_elements


def moe_layout(args: object = MOE, **kw: int) -> Layout:
    return Layout(flavor="debugmoe", seq_len=256, local_batch_size=2, model=args, **kw)  # type: ignore[arg-type]


def test_memory_grows_with_experts_and_gathered_experts_shrink_with_ep() -> None:
    more = replace(MOE, n_routed_experts=16)
    small, big = memory(MOE, moe_layout(dp_shard=8), H100), memory(more, moe_layout(more, dp_shard=8), H100)
    assert big.parameters > small.parameters and big.optimizer > small.optimizer
    by_ep = [memory(MOE, moe_layout(dp_shard=8, ep=ep), H100) for ep in (1, 2, 8)]
    # every rank holds 1 / 8 of the experts either way; EP shrinks what FSDP gathers (E / ep experts per block)
    assert by_ep[0].parameters == by_ep[1].parameters == by_ep[2].parameters
    assert by_ep[0].comm_buffers > by_ep[1].comm_buffers > by_ep[2].comm_buffers
    layout = moe_layout(dp_shard=8, ep=2)
    assert routed_rank_numel(MOE, layout, 0) == 3 * 3 * (8 // 2) * (256 // 4) * 256  # 3 MoE blocks, 4 experts, 1/4
    assert by_ep[1].activations > by_ep[0].activations  # the busiest EP rank's headroom


def test_compute_counts_active_parameters_and_all_to_all_is_added() -> None:
    one, two = estimate(moe_layout(dp_shard=8), H100), estimate(moe_layout(dp_shard=8, ep=2), H100)
    assert one.time["exposed_ep_comm"] == 0.0 < two.time["exposed_ep_comm"]
    # the FFN a token runs: 1 dense block of 768, 3 MoE blocks of shared 256 + top-2 x 256 (x 1.25 under EP)
    assert compute_view(MOE, 1, 1).ffn_hidden_dim == 768 and compute_view(MOE, 1, 2).ffn_hidden_dim == 864
    dense = get_flavor("8B")
    assert compute_view(dense, 8, 1) == dense
    peak = H100.spec.peak_bf16_flops
    assert one.mfu_pct == pytest.approx(100 * one.tps_per_device * flops_per_token(MOE, 256) / peak)  # active FLOPs


def test_search_tries_ep_for_moe_only() -> None:
    base = Layout(flavor="deepseek_v3_671B", seq_len=4096, local_batch_size=1, dp_shard=256)
    result = advisor.search(base, 256, H100)
    assert result.best.layout.ep > 1 and result.best.fits
    assert {e.layout.ep for e in result.ranked} > {result.best.layout.ep}
    assert advisor.ep_options(MOE, 1, 8, 1) == [1, 2, 4, 8] and advisor.ep_options(MOE, 2, 4, 1) == [1]
    assert advisor.ep_options(get_flavor("8B"), 1, 64, 1) == [1]
    dense = advisor.search(Layout(flavor="8B", seq_len=8192, local_batch_size=2, dp_shard=8), 8, H100)
    assert {e.layout.ep for e in dense.ranked} == {1}


@pytest.mark.parametrize(
    ("flavor", "world", "ep", "needle"),
    [
        ("debugmoe", "12", "3", "does not divide the 8 routed experts"),
        ("debugmoe", "8", "16", "must divide data_parallel_shard x context degrees = 8"),
        ("debugmodel", "8", "2", "needs an MoE flavor"),
    ],
)
def test_bad_ep_is_one_line(flavor: str, world: str, ep: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model.flavor", flavor, "--world-size", world, "--hardware", "h100"]
    assert main([*argv, "--parallelism.expert_parallel_degree", ep, "--training.seq_len", "256"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and needle in err
    with pytest.raises(ConfigError, match=r"compile\.enable"):
        estimate(replace(moe_layout(dp_shard=8, ep=2), compile=True), H100)
