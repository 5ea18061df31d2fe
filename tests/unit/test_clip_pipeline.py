"""Gradient clipping across pipeline stages with known gradients: every stage scales by max_norm / the global norm
(one scale for all stages), so the global norm after clipping is max_norm. Stage 0 of a 2-stage pipeline runs here; the
all-reduce over the pp group is a fake group's, made to add stage 1's known squared norm (what SUM gives)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from fakeworld import fake_rank
from torch.distributed.device_mesh import init_device_mesh

from meshforge.train import optim
from meshforge.train.optim import clip_grad_norm_


def test_pipeline_stages_clip_by_one_global_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    other_stage_norm = 12.0  # stage 1's gradients; stage 0's below have norm 5: global 13
    params = [torch.zeros(2, requires_grad=True), torch.zeros(1, 1, requires_grad=True)]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])

    def all_reduce(tensor: torch.Tensor, group: object = None, **_: object) -> None:
        tensor += other_stage_norm**2

    monkeypatch.setattr(optim.dist, "all_reduce", all_reduce)
    with fake_rank(0, 2):
        pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        total = clip_grad_norm_(params, max_norm=1.3, pp_mesh=pp_mesh)
        assert dist.is_initialized()
    assert math.isclose(float(total), 13.0, rel_tol=1e-12), "the returned norm is not the global one"
    scale = float(params[0].grad[0]) / 3.0  # type: ignore[index]
    assert math.isclose(scale, 1.3 / 13.0, rel_tol=1e-6), (
        f"stage 0 scaled its gradients by {scale:.4f}, not max_norm / global norm = 0.1: each pipeline stage clipped "
        "by its own norm"
    )
    assert math.isclose(float(params[1].grad), 4.0 * scale, rel_tol=1e-6)  # type: ignore[arg-type]
    after = math.hypot(5.0 * scale, other_stage_norm * scale)
    assert math.isclose(after, 1.3, rel_tol=1e-6), f"global norm after clipping {after} != max_norm 1.3"


def test_max_norm_zero_only_measures() -> None:
    params = [torch.zeros(2, requires_grad=True)]
    params[0].grad = torch.tensor([3.0, 4.0])
    total = clip_grad_norm_(params, max_norm=0.0, pp_mesh=None)
    assert float(total) == 5.0
    assert params[0].grad.tolist() == [3.0, 4.0], "max_norm 0 (clipping off) changed the gradients"
