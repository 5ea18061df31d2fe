"""Blockwise attention merged by log-sum-exp (the core of context parallel) against one full causal SDPA, forward and
backward, on one process: every cp rank's share is computed here from the full K/V, then the shares are summed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshforge.parallel.context_parallel.api import _GatheredKVAttention, load_balanced_positions
from meshforge.parallel.context_parallel.blocks import Block, CpuFlash, MathKernel, attend, attend_backward, kernel_for
from meshforge.parallel.context_parallel.ring import step_pairs


def qkv(heads: int, kv_heads: int, seq: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, heads, seq, 16), (2, kv_heads, seq, 16), (2, kv_heads, seq, 16)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    """fp32 full causal attention with K/V repeated per query head (no GQA kernel): out, dq, dk, dv."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )
    out.backward(dout.float())
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


@pytest.mark.parametrize(("cp", "kv_heads", "dtype", "tol"), [
    (2, 4, torch.float32, 1e-5), (4, 2, torch.float32, 1e-5),
    (2, 1, torch.bfloat16, 3e-2), (4, 2, torch.bfloat16, 3e-2),
])  # fmt: skip
def test_gathered_kv_attention_matches_full_causal_attention(
    cp: int, kv_heads: int, dtype: torch.dtype, tol: float
) -> None:
    """Each rank's two query chunks against the global-order K/V: the outputs are the full attention's rows and the
    ranks' dq / dk / dv add up to the full attention's gradients (GQA at K/V width; bf16 against fp32)."""
    seq = 16 * cp
    q, k, v = qkv(4, kv_heads, seq, dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_out, want_dq, want_dk, want_dv = reference(q, k, v, dout)
    dq, dk, dv = torch.zeros_like(want_dq), torch.zeros_like(want_dk), torch.zeros_like(want_dv)
    for rank in range(cp):
        pos = load_balanced_positions(seq, cp, rank)
        q_local = q.detach()[:, :, pos].requires_grad_()
        k_seq, v_seq = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        out = _GatheredKVAttention.apply(q_local, k_seq, v_seq, rank, cp)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want_out[:, :, pos], atol=tol, rtol=tol)
        out.backward(dout[:, :, pos])
        dq[:, :, pos] += q_local.grad.float()  # type: ignore[union-attr]
        dk += k_seq.grad.float()  # type: ignore[union-attr]
        dv += v_seq.grad.float()  # type: ignore[union-attr]
    for got, want in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_math_kernel_matches_the_cpu_flash_kernel() -> None:
    """The math kernel (CUDA fp32 and other devices) gives the fused kernel's merged result and gradients, GQA 4:2."""
    q, k, v = (t.detach() for t in qkv(4, 2, 24, torch.float32))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    q_rows = q[:, :, 16:24]
    blocks = [Block(k[:, :, :16], v[:, :, :16], False), Block(k[:, :, 16:24], v[:, :, 16:24], True)]
    results = []
    for kernel in (CpuFlash(), MathKernel()):
        out, lse, aux = attend(kernel, q_rows, blocks)
        dq, dkv = attend_backward(kernel, dout[:, :, 16:24], q_rows, blocks, out, lse, aux)
        results.append([out, lse, dq, *[g for pair in dkv for g in pair]])
    for flash, math in zip(*results, strict=True):
        torch.testing.assert_close(flash.float(), math.float(), atol=1e-5, rtol=1e-5)


def test_kernel_choice() -> None:
    assert kernel_for(torch.device("cpu"), torch.bfloat16).name == "cpu-flash"
    assert kernel_for(torch.device("cuda"), torch.bfloat16).name == "cuda-flash"
    assert kernel_for(torch.device("cuda"), torch.float32).name == "math"


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_steps_cover_each_causal_pair_once(cp: int) -> None:
    """Over the cp steps of the ring, each query chunk meets every earlier chunk once unmasked and itself once
    causally (at step 0), and no later chunk."""
    for rank in range(cp):
        seen: dict[int, list[tuple[int, bool]]] = {rank: [], 2 * cp - 1 - rank: []}
        for step in range(cp):
            src = (rank - step) % cp
            q_ids, kv_ids = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
            for i, m, causal in step_pairs(rank, src, cp):
                seen[q_ids[i]].append((kv_ids[m], causal))
                assert causal == (step == 0 and i == m)
        for chunk, pairs in seen.items():
            assert sorted(pairs) == [(j, j == chunk) for j in range(chunk + 1)]
