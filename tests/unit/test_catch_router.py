"""The router's branches the debug models never reach (issue 37: "code that no test model exercises"): debugmoe
routes with softmax scores, normalised top-2, scale 1 and no expert groups; DeepSeek-V3 routes with sigmoid scores,
a bias-corrected top-8 within the best 4 of 8 groups (a group scored by its best two experts), scale 2.5. Each
setting is checked token by token against a plain loop written from that description."""

from __future__ import annotations

import pytest
import torch

from meshforge.model.flavors import ModelArgs
from meshforge.model.moe import Router


def reference(scores: torch.Tensor, bias: torch.Tensor, args: ModelArgs) -> tuple[list[set[int]], torch.Tensor]:
    """Per token: the chosen experts and their gate values (sorted by expert id), one token at a time."""
    chosen, gates = [], []
    per_group = args.n_routed_experts // max(1, args.n_expert_groups)
    for row in scores:
        biased = row + bias
        allowed = list(range(args.n_routed_experts))
        if args.n_expert_groups > 1:
            group_score = [
                sorted(biased[g * per_group : (g + 1) * per_group].tolist())[-2:] for g in range(args.n_expert_groups)
            ]
            best = sorted(range(args.n_expert_groups), key=lambda g: -sum(group_score[g]))[: args.n_limited_groups]
            allowed = [e for e in allowed if e // per_group in best]
        top = sorted(allowed, key=lambda e: -float(biased[e]))[: args.top_k]
        values = torch.stack([row[e] for e in sorted(top)])  # gate values come from the unbiased scores
        if args.route_norm:
            values = values / values.sum()
        chosen.append(set(top))
        gates.append(values * args.route_scale)
    return chosen, torch.stack(gates)


@pytest.mark.parametrize(
    "settings",
    [
        dict(score_func="sigmoid", n_expert_groups=4, n_limited_groups=2, route_norm=False, route_scale=2.5),
        dict(score_func="sigmoid", n_expert_groups=4, n_limited_groups=1, route_norm=True, route_scale=1.0),
        dict(score_func="softmax", n_expert_groups=1, n_limited_groups=1, route_norm=False, route_scale=16.0),
    ],
    ids=["deepseek-v3-like", "one-group-normalised", "softmax-unnormalised"],
)
def test_router_matches_a_token_by_token_reference(settings: dict[str, object]) -> None:
    args = ModelArgs(dim=16, n_routed_experts=16, top_k=4, moe_ffn_dim=8, **settings)  # type: ignore[arg-type]
    torch.manual_seed(3)
    router = Router(args)
    x, bias = torch.randn(40, 16), torch.randn(16) * 0.3
    gates, indices, scores = router(x, bias)
    logits = router.gate(x).float()
    want_scores = logits.sigmoid() if settings["score_func"] == "sigmoid" else logits.softmax(-1)
    assert torch.allclose(scores, want_scores)
    chosen, want_gates = reference(want_scores, bias, args)
    assert [set(row.tolist()) for row in indices] == chosen
    order = indices.argsort(dim=-1)  # the router's order: by biased score; the reference's: by expert id
    assert torch.allclose(gates.gather(1, order), want_gates, rtol=1e-5, atol=1e-6)
