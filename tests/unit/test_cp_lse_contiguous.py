"""The CUDA flash backward reads the log-sum-exp by raw pointer as if contiguous: both context-parallel cores must hand
every fused attention backward a contiguous LSE (a ``lse[:, :, rows]`` slice is not, for every head after the first;
the forward and every CPU result look fine, dq/dk/dv on CUDA are wrong). Recorded on CPU with a dispatch mode: the CPU
flash backward receives exactly what the CUDA one would."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.parallel.context_parallel import AllGatherKVAttention
from meshforge.parallel.context_parallel.ring import RingAttention

FLASH_BACKWARDS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 5,  # index of the lse argument
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: 5,
}


class RecordLse(TorchDispatchMode):
    """Records (shape, is_contiguous) of the LSE each flash-attention backward receives."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in FLASH_BACKWARDS:
            lse = args[FLASH_BACKWARDS[func]]
            self.seen.append((tuple(lse.shape), lse.is_contiguous()))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cp_mesh() -> Any:
    """Rank 0 of 2 on torch's fake process group: collectives return at once (values unchecked here: the parity of
    both cores is tests/distributed/test_cp_attention.py), shapes and strides are the real ones."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("core", [AllGatherKVAttention, RingAttention])
def test_flash_backward_gets_a_contiguous_lse(core: Any, cp_mesh: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    out = core(cp_mesh)(q, k, v)
    recorder = RecordLse()
    with recorder:
        out.float().square().sum().backward()
    assert recorder.seen, "no flash-attention backward ran"
    bad = [shape for shape, contiguous in recorder.seen if not contiguous]
    assert not bad, f"{core.__name__}: non-contiguous LSE of shape {bad[0]} passed to the flash backward"
