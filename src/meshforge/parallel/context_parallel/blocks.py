"""Attention over blocks of keys, merged by log-sum-exp, with an exact backward: the core of context parallel.

A query chunk attends to several key/value blocks (earlier chunks unmasked, its own chunk causal); each block's partial
attention comes from a fused kernel that also returns the rows' log-sum-exp (LSE), and the partials merge exactly:
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``. No dense mask and no
score matrix is ever held: memory is linear in the sequence.

The backward is FlashAttention's: a block's gradients follow from the *merged* output and LSE alone
(``P = exp(S - lse)``, ``dS = P (dP - rowsum(dO * O))``), so each block calls its kernel's backward with the global
``out`` and ``lse`` and the results add up to the gradients of attention over the union of the blocks. The fused
kernels' LSE carries no autograd graph, hence the hand-written backward (``torch.autograd.Function`` in the callers).

Kernels, picked by device and dtype (:func:`kernel_for`), all with grouped-query attention at K/V-head width:
``cpu-flash`` (``aten._scaled_dot_product_flash_attention_for_cpu``, any dtype), ``cuda-flash``
(``aten._scaled_dot_product_flash_attention``, bf16/fp16 on CUDA), and ``math`` (plain tensor ops, any device and dtype:
scores are materialised one block at a time and never saved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

# (dq, dk, dv) of one block
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Kernel(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Any, ...]:
        """(out, lse fp32 (batch, heads, q_len), aux for the backward) of q against one K/V block."""
        ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, aux: Any, causal: bool,
    ) -> Grads:  # fmt: skip
        """This block's share of (dq, dk, dv), given the merged ``out`` and ``lse`` of all blocks."""
        ...


class CpuFlash:
    name = "cpu-flash"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Any, ...]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, None

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, aux: Any, causal: bool,
    ) -> Grads:  # fmt: skip
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal
        )
        return grads[0], grads[1], grads[2]


class CudaFlash:
    """FlashAttention-2 through aten (bf16/fp16; grouped-query attention native). Not yet run on a GPU here."""

    name = "cuda-flash"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Any, ...]:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, aux: Any, causal: bool,
    ) -> Grads:  # fmt: skip
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset
        )
        return grads[0], grads[1], grads[2]


class MathKernel:
    """Plain tensor ops in fp32; the scores of one block live only inside the call (any device, any dtype)."""

    name = "math"

    @staticmethod
    def _probs(q: torch.Tensor, k: torch.Tensor, causal: bool, lse: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        heads, head_dim = q.shape[1], q.shape[3]
        groups = heads // k.shape[1]
        qg = q.float().unflatten(1, (k.shape[1], groups))  # (batch, kv_heads, groups, q_len, head_dim)
        scores = qg @ k.float()[:, :, None].transpose(-1, -2) * head_dim**-0.5  # (batch, kv_heads, groups, q, k)
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0, 0, 0], dtype=torch.bool).triu(1), float("-inf"))
        own_lse = torch.logsumexp(scores, dim=-1) if lse is None else lse.unflatten(1, (k.shape[1], groups))
        return qg, torch.exp(scores - own_lse[..., None]), own_lse

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Any, ...]:
        _, probs, lse = self._probs(q, k, causal, None)
        out = probs @ v.float()[:, :, None]  # (batch, kv_heads, groups, q_len, head_dim)
        return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2), None

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, aux: Any, causal: bool,
    ) -> Grads:  # fmt: skip
        qg, probs, _ = self._probs(q, k, causal, lse)
        kv_heads, scale = k.shape[1], q.shape[-1] ** -0.5
        do = dout.float().unflatten(1, (kv_heads, -1))
        dv = (probs.transpose(-1, -2) @ do).sum(2)
        delta = (do * out.float().unflatten(1, (kv_heads, -1))).sum(-1, keepdim=True)
        ds = probs * (do @ v.float()[:, :, None].transpose(-1, -2) - delta)
        dq = (ds @ k.float()[:, :, None]).flatten(1, 2) * scale
        dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def kernel_for(device: torch.device, dtype: torch.dtype) -> Kernel:
    """The fused LSE-returning kernel for this device and dtype, or the math kernel where none applies."""
    if device.type == "cpu":
        return CpuFlash()
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return CudaFlash()
    return MathKernel()


@dataclass
class Partial:
    """A query chunk's running attention: fp32 output (batch, heads, q_len, head_dim) and LSE (batch, heads, q_len)."""

    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def add(self, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
        """Merge one block's partial attention into the running result (exact, numerically stable)."""
        block_out, block_lse = block_out.float(), block_lse.float()
        if self.out is None or self.lse is None:
            self.out, self.lse = block_out, block_lse
            return
        lse = torch.logaddexp(self.lse, block_lse)
        self.out = self.out * torch.exp(self.lse - lse)[..., None] + block_out * torch.exp(block_lse - lse)[..., None]
        self.lse = lse


@dataclass(frozen=True)
class Block:
    """One K/V block a query chunk attends to; ``causal`` for the diagonal block (equal, aligned chunks)."""

    k: torch.Tensor
    v: torch.Tensor
    causal: bool


def attend(kernel: Kernel, q: torch.Tensor, blocks: list[Block]) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """q (batch, heads, q_len, head_dim) against every block: (out in q's dtype, fp32 lse, each block's aux)."""
    partial, auxes = Partial(), []
    for block in blocks:
        out, lse, aux = kernel.forward(q, block.k, block.v, block.causal)
        partial.add(out, lse)
        auxes.append(aux)
    assert partial.out is not None and partial.lse is not None, "a query chunk needs at least one block"
    return partial.out.to(q.dtype), partial.lse, auxes


def attend_backward(
    kernel: Kernel, dout: torch.Tensor, q: torch.Tensor, blocks: list[Block], out: torch.Tensor, lse: torch.Tensor,
    auxes: list[Any],
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:  # fmt: skip
    """fp32 dq of the query chunk and (dk, dv) of each block, from the merged out and lse."""
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv = []
    for block, aux in zip(blocks, auxes, strict=True):
        block_dq, dk, dv = kernel.backward(dout, q, block.k, block.v, out, lse, aux, block.causal)
        dq += block_dq
        dkv.append((dk, dv))
    return dq, dkv


def cat_seq_major(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Attention outputs (batch, heads, chunk, head_dim) joined along the sequence, laid out (batch, seq, heads,
    head_dim) in memory as SDPA's own outputs are: the block's ``transpose(1, 2).reshape`` for wo is then a view of
    the output the core saves, not a second saved copy (a contiguous (batch, heads, seq) output cost one more
    attention-output per block: 16 MiB per block-micro-batch at the 405B layout, measured by --by-op)."""
    return torch.cat([c.transpose(1, 2) for c in chunks], dim=1).transpose(1, 2)
