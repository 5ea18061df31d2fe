"""Both context-parallel attention cores on real gloo ranks against one full causal SDPA: every rank's output rows and
the gradients of q, k and v (K/V at K/V-head width, GQA), at cp 2 and cp 4, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from launcher import run_ranks

DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 3e-2)}


def inputs(seq: int, kv_heads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 4, seq, 16), (2, kv_heads, seq, 16), (2, kv_heads, seq, 16), (2, 4, seq, 16)]
    return [torch.randn(s, generator=gen) for s in shapes]  # q, k, v, dout


def compare_on_rank(impl: str, dtype_name: str, kv_heads: int) -> float:
    """Runs inside a rank: this rank's slice through the cp core vs the full attention's slice; the max abs error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.parallel.context_parallel import AllGatherKVAttention, load_balanced_positions
    from meshforge.parallel.context_parallel.ring import RingAttention

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    dtype, tol = DTYPES[dtype_name]
    q, k, v, dout = inputs(16 * cp, kv_heads)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = 4 // kv_heads
    want = F.scaled_dot_product_attention(
        full[0], full[1].repeat_interleave(groups, 1), full[2].repeat_interleave(groups, 1), is_causal=True
    )
    want.backward(dout)
    pos = load_balanced_positions(16 * cp, cp, rank)
    local = [t[:, :, pos].to(dtype).requires_grad_() for t in (q, k, v)]
    core = AllGatherKVAttention(mesh) if impl == "allgather" else RingAttention(mesh)
    out = core(*local)
    out.backward(dout[:, :, pos].to(dtype))
    assert out.dtype == dtype and local[1].grad.shape == local[1].shape  # type: ignore[union-attr]
    errors = [(out.float() - want.detach()[:, :, pos]).abs().max()]
    errors += [(t.grad.float() - f.grad[:, :, pos]).abs().max() for t, f in zip(local, full, strict=True)]  # type: ignore[union-attr, index]
    worst = float(torch.stack(errors).max())
    assert worst <= tol, f"rank {rank}: {impl} {dtype_name} max error {worst} > {tol}"
    return worst


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["allgather", "ring"])
@pytest.mark.parametrize(("cp", "dtype", "kv_heads"), [(2, "float32", 2), (4, "float32", 1), (2, "bfloat16", 4)])
def test_cp_attention_matches_full_attention(impl: str, cp: int, dtype: str, kv_heads: int) -> None:
    run_ranks(compare_on_rank, cp, impl, dtype, kv_heads)
