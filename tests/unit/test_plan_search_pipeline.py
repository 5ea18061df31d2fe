"""The search proposes every pipeline degree training can split the model into (parallel/pipeline/split.py), not only
up to n_layers / 2, and prices a deep pipeline with its real, uneven stages."""

from __future__ import annotations

from meshforge.config.io import load_config
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout, layout_args, layout_from_config, stage_layer_counts
from meshforge.plan.physics.estimate import rates, stage_costs
from meshforge.plan.search import advisor

# the bench default's job (configs/bench/default.toml): debugmodel (6 layers), seq 128, fp32, AC none
ARGV = [
    "--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.mixed_precision_param", "float32",
    "--activation_checkpoint.mode", "none",
]  # fmt: skip


def _base(world: int, local_batch: int) -> Layout:
    return layout_from_config(load_config(None, [*ARGV, "--training.local_batch_size", str(local_batch)]), world)


def test_every_degree_training_splits_is_proposed() -> None:
    """debugmodel: 6 layers + 1 + 1 for the embedding and the output (first/last_stage_less_layers), so PP 4 and PP 8
    split (the first and last stage a block or more short) and PP 16 does not."""
    base = _base(8, 1)
    result = advisor.search(base, 8, load_hardware("cpu"))
    assert {e.layout.pp for e in result.ranked} == {1, 2, 4, 8}
    args = layout_args(base)
    assert advisor.pipeline_splits(args, base, 8) and not advisor.pipeline_splits(args, base, 16)


def test_the_bench_jobs_best_layout_at_4_ranks_is_pp_4_priced_with_its_uneven_stages() -> None:
    """Global batch 4 on 4 CPU ranks: PP 4 (stages of 1, 2, 2, 1 blocks) is the planner's fastest, over FSDP 2 x PP 2;
    its first and last stages cost their own blocks plus the embedding / output, not n_layers / pp each."""
    hw = load_hardware("cpu")
    result = advisor.search(_base(4, 1), 4, hw)
    best = result.best.layout
    assert (best.pp, best.dp, best.tp, best.cp) == (4, 1, 1, 1)
    args = layout_args(best)
    assert stage_layer_counts(args.n_layers, best) == [1, 2, 2, 1]
    costs = [c.forward + c.backward for c in stage_costs(args, best, hw, rates(best, hw), 1.0)]
    assert costs[0] < costs[1] == costs[2] and costs[3] > costs[0]  # the output's vocab matmul outweighs a block
