"""The analytical parameter bytes equal what the real FSDP2 / TP sharding allocates on rank 0 (fake process group)."""

from __future__ import annotations

import pytest

from meshforge.model.flavors import get_flavor
from meshforge.plan.accuracy.exact import ExactCase, analytical_param_numel, exact_param_numel
from meshforge.plan.layout import Layout, stage_layer_counts


def test_exact_matches_analytical_for_8b_fsdp8_and_70b_fsdp32_tp8() -> None:
    cases = [ExactCase("8B", 8, 1), ExactCase("70B", 32, 8)]
    exact = exact_param_numel(cases)
    analytical = [analytical_param_numel(c) for c in cases]
    assert exact == analytical
    assert exact[0] * 16 / 2**30 == pytest.approx(14.96, abs=0.01)  # fp32 params + grads + AdamW: 16 bytes each


@pytest.mark.parametrize(
    ("n_layers", "stages", "first", "last"),
    [(126, 8, 1, 1), (126, 16, 1, 1), (32, 4, 1, 1), (80, 16, 0, 0), (6, 4, 1, 1)],
)
def test_stage_split_matches_the_pipeline_code(n_layers: int, stages: int, first: int, last: int) -> None:
    split_evenly = pytest.importorskip("meshforge.parallel.pipeline.split").split_evenly
    layout = Layout(
        flavor="8B",
        seq_len=8192,
        local_batch_size=8,
        pp=stages,
        first_stage_less_layers=first,
        last_stage_less_layers=last,
    )
    theirs = [
        sum(name.startswith("layers.") for name in names) for names in split_evenly(n_layers, stages, first, last)
    ]
    assert stage_layer_counts(n_layers, layout) == theirs


def test_pipeline_rank0_holds_the_first_stage() -> None:
    from meshforge.plan.physics.parts import local_param_numel, part_numel, rank_parts

    args = get_flavor("405B")
    layout = Layout(flavor="405B", seq_len=8192, local_batch_size=32, dp_shard=8, tp=8, pp=8)
    parts = rank_parts(args, layout, 0)
    assert (parts.layers, parts.embedding, parts.head) == (15, True, False)
    expected = 15 * part_numel(args, "block", 8, 8) + part_numel(args, "embedding", 8, 8)
    assert local_param_numel(args, layout, parts) == expected
