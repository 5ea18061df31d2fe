"""Document masking: attention block-causal within each packed document.

The loader gives each token its position within its document (restarting at 0 at every document start); the same
positions index RoPE, so each document sees the rotary phases it would see alone, and a token attends only to earlier
tokens of its own document. The mask is built once per forward from those positions: on CUDA a flex-attention
``BlockMask`` (compiled flex attention skips the masked blocks), elsewhere a dense boolean mask for SDPA (exact; the
CPU path, also the fallback).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

DocumentMask = Any
"""A boolean (batch, 1, seq, seq) tensor, or a flex-attention BlockMask."""


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) in-document positions -> (batch, seq) document numbers (a new one starts at every position 0)."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=1)


def build_document_mask(positions: torch.Tensor, use_flex: bool | None = None) -> DocumentMask:
    """The mask of a batch from its in-document positions (batch, seq); flex attention by default on CUDA."""
    docs = document_ids(positions)
    batch, seq = docs.shape
    if use_flex if use_flex is not None else docs.device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return (docs[b, q] == docs[b, kv]) & (q >= kv)

        return create_block_mask(same_document_causal, batch, None, seq, seq, device=docs.device)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]  # (batch, 1, seq, seq)


_compiled_flex: Any = None


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Attention of q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim) under a document mask."""
    gqa = k.shape[1] != q.shape[1]  # grouped-query attention: k and v keep their kv heads
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.device.type != "cuda":  # flex attention's unfused reference path (tests of the CUDA path on a CPU)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)  # type: ignore[return-value]
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=gqa)  # type: ignore[no-any-return]
