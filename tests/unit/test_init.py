"""Weight initialisation: the one-pass truncated normal has the distribution of torch's trunc_normal_ and is
reproducible from its generator."""

from __future__ import annotations

import torch

from meshforge.model.llama import truncated_normal_


def test_truncated_normal_matches_torch_and_repeats() -> None:
    gen = torch.Generator().manual_seed(0)
    ours = truncated_normal_(torch.empty(400_000), 0.02, 2.0, gen)
    theirs = torch.nn.init.trunc_normal_(torch.empty(400_000), std=0.02, a=-0.04, b=0.04, generator=gen)
    assert ours.abs().max() <= 0.04 and abs(ours.mean().item()) < 1e-4
    assert abs(ours.std().item() / theirs.std().item() - 1) < 0.01  # 0.880 x std for a 2-sigma truncation
    for q in (0.1, 0.5, 0.9):
        assert abs(ours.quantile(q).item() - theirs[:100_000].quantile(q).item()) < 5e-4
    again = truncated_normal_(torch.empty(1000), 0.02, 2.0, torch.Generator().manual_seed(7))
    assert torch.equal(again, truncated_normal_(torch.empty(1000), 0.02, 2.0, torch.Generator().manual_seed(7)))
