"""``CudaFlash`` (parallel/context_parallel/blocks.py) executed: forward and the blockwise backward against dense causal
SDPA on the same GPU, in bf16 with several heads (a non-contiguous LSE would corrupt every head after the first).
Marked ``gpu``: skipped, with one line, where torch has no CUDA device (every CPU machine, CI)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshforge.parallel.context_parallel.blocks import Block, CudaFlash, attend, attend_backward, kernel_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CudaFlash runs only there)"),
]


def test_cuda_flash_blocks_match_dense_causal_sdpa() -> None:
    device, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 8, 1024, 64, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(4))
    kernel = kernel_for(device, torch.bfloat16)
    assert isinstance(kernel, CudaFlash)
    half = 512  # the second query half attends to the first K/V half (unmasked) and its own (causal)
    blocks = [Block(k[:, :, :half], v[:, :, :half], False), Block(k[:, :, half:], v[:, :, half:], True)]
    out, lse, auxes = attend(kernel, q[:, :, half:], blocks)
    dq, dkv = attend_backward(kernel, dout[:, :, half:], q[:, :, half:], blocks, out, lse.contiguous(), auxes)
    full = [t.float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want[:, :, half:].backward(dout[:, :, half:].float())
    assert (out.float() - want[:, :, half:]).abs().max() < 3e-2
    assert (dq - full[0].grad[:, :, half:]).abs().max() < 5e-2  # type: ignore[index]
    dk = torch.cat([dkv[0][0], dkv[1][0]], dim=2).float()
    assert (dk - full[1].grad).abs().max() < 5e-2  # type: ignore[operator]
