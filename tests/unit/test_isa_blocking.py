"""What made the composability matrix CPU-dependent (issue 43): tests/blocking.py's second blocking of every matmul
(the noise floor the matrix's Float8 tolerances come from) and activation offload's saved tensors keeping their
strides (a contiguous copy of a transposed view sent backward's matmuls to other kernels: other bits on Intel's)."""

from __future__ import annotations

import torch
from blocking import KSplitMatmul

from meshforge.parallel.activation_offload import HostCopyOffload


def test_second_blocking_changes_bits_within_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=gen), torch.randn(512, 96, generator=gen)
    bias, batch = torch.randn(96, generator=gen), torch.randn(3, 64, 512, generator=gen)
    plain = (a @ b, torch.addmm(bias, a, b), torch.bmm(batch, b.expand(3, -1, -1)))
    calls: list[int] = []
    with KSplitMatmul(3):
        split = (a @ b, torch.addmm(bias, a, b), torch.bmm(batch, b.expand(3, -1, -1)))
        calls.append(1)
    for x, y in zip(plain, split, strict=True):
        assert not torch.equal(x, y)  # another summation order: the floor is not zero by construction
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-4)  # and the same product
    assert calls


def test_second_blocking_reaches_float8_matmuls() -> None:
    """Float8 tensors (torchao) first unwrap; their plain matmuls come back to the mode and are split."""
    import blocking

    float8 = __import__("torchao.float8", fromlist=["convert_to_float8_training"])
    seen: list[tuple[int, ...]] = []
    inner = blocking._ksplit_mm

    def spy(a: torch.Tensor, b: torch.Tensor, parts: int) -> torch.Tensor:
        seen.append(tuple(a.shape))
        return inner(a, b, parts)

    blocking._ksplit_mm = spy
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
        config = float8.Float8LinearConfig.from_recipe_name("rowwise")
        config = float8.Float8LinearConfig(**{**config.__dict__, "emulate": True})
        float8.convert_to_float8_training(model, config=config)
        with KSplitMatmul(2):
            model(torch.randn(16, 64)).sum().backward()
    finally:
        blocking._ksplit_mm = inner
    assert len(seen) >= 3 * 2  # forward, input grad, weight grad, each in two column halves


def test_offload_keeps_the_saved_tensors_strides() -> None:
    """A saved transposed view comes back with its strides: backward's matmul sees the layout it would have seen."""
    weight = torch.randn(48, 32)
    dense = (weight.t(), weight, torch.randn(4, 5, 6).permute(2, 0, 1))
    for saved in (*dense, weight[:, ::2], weight[:1].expand(3, 32)):  # the last two are copied contiguous
        back = HostCopyOffload.unpack(HostCopyOffload.pack(saved))
        assert torch.equal(back, saved) and (back.stride() == saved.stride() or all(saved is not d for d in dense))
        assert back.data_ptr() != saved.data_ptr()  # a copy, not the tensor itself


def test_offload_gives_the_same_bits_as_no_offload() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(64, 32))
    h = torch.randn(8, 32, requires_grad=True)

    def grads(offload: bool) -> list[torch.Tensor]:
        emb.grad, h.grad = None, None
        with HostCopyOffload() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = (h @ emb.t()).logsumexp(-1).sum()  # a tied output projection: the saved weight is a transposed view
        loss.backward()
        return [emb.grad.clone(), h.grad.clone()]

    for x, y in zip(grads(False), grads(True), strict=True):
        assert torch.equal(x, y)
