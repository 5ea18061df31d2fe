"""Under expert parallel every routed-experts module scales its gradient by 1 / ep (parallel/expert_parallel.py): an
expert's gradient sums the tokens of all its ep peers, FSDP then averages over the ranks left after EP, so the scale
makes it the data-parallel mean. Checked on the real parallelization of a fake world, and the scale's backward on
its own; the 2-rank proof (grad norms vs one process) is tests/distributed/test_moe_parity.py."""

from __future__ import annotations

import pytest
import torch
from fakeworld import parallelized

from meshforge.model.moe import GroupedExperts, ScaleGrad


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 4), (4, 2)])
def test_every_expert_module_scales_its_gradient_by_one_over_ep(world: int, ep: int) -> None:
    overrides = ["--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", str(ep)]
    with parallelized(overrides, world=world) as parts:
        scales = {
            n: m.grad_scale for stage in parts[0] for n, m in stage.named_modules() if isinstance(m, GroupedExperts)
        }
    assert scales, "no routed experts in debugmoe"
    wrong = {n: s for n, s in scales.items() if s != 1.0 / ep}
    assert not wrong, f"expert gradients not scaled by 1 / ep = {1 / ep} (the EP gradient scale): {wrong}"


def test_scale_grad_is_identity_forward_and_scales_backward() -> None:
    w = torch.ones(3, requires_grad=True)
    out = ScaleGrad.apply(w, 0.25)
    assert torch.equal(out, w)
    out.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 0.25))
