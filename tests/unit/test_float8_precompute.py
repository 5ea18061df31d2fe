"""Float8 tensorwise + FSDP float8 all-gather: the scales are precomputed after the optimizer step (one all-reduce)
and the next step uses them; without float8 all-gather nothing is precomputed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from meshforge.config.schema import Float8
from meshforge.parallel.float8 import apply_float8, fsdp_float8_all_gather, precompute_float8_scales


@pytest.fixture
def one_rank_group(tmp_path: Path):  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_when_scales_are_precomputed() -> None:
    on = Float8(enable=True, emulate=True)
    assert fsdp_float8_all_gather(on, fsdp=True)
    assert not fsdp_float8_all_gather(on, fsdp=False)
    assert not fsdp_float8_all_gather(Float8(enable=True, recipe_name="rowwise"), fsdp=True)
    assert not fsdp_float8_all_gather(Float8(enable=True, enable_fsdp_float8_all_gather=False), fsdp=True)
    assert not fsdp_float8_all_gather(Float8(enable=False), fsdp=True)


def test_precompute_sets_every_weights_scale_and_training_goes_on(one_rank_group: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False))
    apply_float8(model, Float8(enable=True, emulate=True), fsdp=True)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 64)
    model(x).square().mean().backward()
    optimizer.step()
    weights = [layer.weight._local_tensor for layer in model]  # torchao's WeightWithDynamicFloat8CastTensor
    assert all(w._precomputed_scale is None for w in weights)
    precompute_float8_scales([model])
    for w in weights:
        expected = torch.finfo(torch.float8_e4m3fn).max / w._tensor.abs().max().double().clamp(min=1e-12)
        assert w._precomputed_scale is not None
        assert float(w._precomputed_scale) == pytest.approx(float(expected), rel=1e-3)
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    assert torch.isfinite(loss)
