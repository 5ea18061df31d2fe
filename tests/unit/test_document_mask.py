"""Document masking: a packed batch with masking gives each document the logits and loss it has alone; the CUDA
path (flex attention's BlockMask) equals the CPU path (SDPA with a dense mask); context parallel is refused."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from meshforge.config.io import ConfigError, load_config
from meshforge.model.document_mask import build_document_mask, masked_attention
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model

LENGTHS = (11, 6, 15)  # three documents packed into one sequence of 32 tokens


def tiny_model(mask: bool) -> torch.nn.Module:
    model = build_model(get_flavor("tiny").with_seq_len(64))
    model.to_empty(device="cpu")
    model.init_weights(5)
    model.document_mask = mask
    return model


def test_packed_documents_match_each_document_alone() -> None:
    torch.manual_seed(0)
    docs = [torch.randint(2, 2048, (n + 1,)) for n in LENGTHS]  # inputs + the next token as the last label
    inputs = torch.cat([d[:-1] for d in docs])[None]
    labels = torch.cat([d[1:] for d in docs])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = tiny_model(True)(inputs, positions)[0]
    plain = tiny_model(False).requires_grad_(False)
    start = 0
    for doc, n in zip(docs, LENGTHS, strict=True):
        alone = plain(doc[None, :-1])[0]
        torch.testing.assert_close(packed[start : start + n], alone, rtol=1e-5, atol=1e-5)
        loss_packed = F.cross_entropy(packed[start : start + n], labels[0, start : start + n])
        assert float(loss_packed) == pytest.approx(float(F.cross_entropy(alone, doc[1:])), rel=1e-5)
        start += n
    unmasked = plain(inputs)[0]  # without the mask the later documents see the earlier ones
    assert not torch.allclose(unmasked[LENGTHS[0] :], packed[LENGTHS[0] :], atol=1e-3)


def test_flex_block_mask_equals_dense_mask() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    positions = torch.stack([torch.cat([torch.arange(n) for n in LENGTHS]), torch.arange(32)])
    dense = masked_attention(q, k, v, build_document_mask(positions, use_flex=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex attention without compile on a CPU: its unfused reference path
        flex = masked_attention(q, k, v, build_document_mask(positions, use_flex=True))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    causal = F.scaled_dot_product_attention(q[1:], k[1:], v[1:], is_causal=True)
    torch.testing.assert_close(dense[1:], causal, rtol=1e-5, atol=1e-5)  # one document = plain causal
    k, v = k[:, :2], v[:, :2]  # grouped-query attention: 2 kv heads for 4 query heads, no copies
    dense = masked_attention(q, k, v, build_document_mask(positions, use_flex=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = masked_attention(q, k, v, build_document_mask(positions, use_flex=True))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    repeated = masked_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), build_document_mask(positions))
    torch.testing.assert_close(dense, repeated, rtol=1e-5, atol=1e-5)


def test_context_parallel_is_refused() -> None:
    with pytest.raises(ConfigError, match="document_mask"):
        load_config(None, ["--training.document_mask", "--parallelism.context_parallel_degree", "2"])
