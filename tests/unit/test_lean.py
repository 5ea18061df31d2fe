"""Lean saves (model/lean.py): the custom RMSNorm and SwiGLU gate against torch autograd's op-by-op graph (values,
input and weight gradients), what they save, the whole model with and without them, and under torch.compile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshforge.model.flavors import FLAVORS
from meshforge.model.lean import rms_norm, rms_norm_reference, silu_mul
from meshforge.model.llama import build_model, canonical_name
from meshforge.tools.memory_ops import SaveRecorder


def grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """fn's output and the gradients of its inputs under a fixed random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(upstream)
    return out.detach(), [t.grad for t in leaves]  # type: ignore[misc]


def norm_inputs(dtype: torch.dtype, shape: tuple[int, ...] = (3, 17, 64)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, weight


@pytest.mark.parametrize("shape", [(3, 17, 64), (2, 5, 4, 16)], ids=["hidden", "per-head"])
def test_rms_norm_fp32_matches_autograd(shape: tuple[int, ...]) -> None:
    x, weight = norm_inputs(torch.float32, shape)
    out, (dx, dw) = grads(lambda a, b: rms_norm(a, b, 1e-5), x, weight)
    ref, (ref_dx, ref_dw) = grads(lambda a, b: rms_norm_reference(a, b, 1e-5), x, weight)
    assert torch.equal(out, ref)  # the same forward ops
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_rms_norm_bf16_is_as_exact_as_autograd() -> None:
    """bf16: the same forward bits; gradients no further from the fp64 truth than autograd's own (plus one bf16 ulp
    of slack per element)."""
    x, weight = norm_inputs(torch.bfloat16)
    out, (dx, dw) = grads(lambda a, b: rms_norm(a, b, 1e-5), x, weight)
    ref, (ref_dx, ref_dw) = grads(lambda a, b: rms_norm_reference(a, b, 1e-5), x, weight)
    _, (true_dx, true_dw) = grads(lambda a, b: rms_norm_reference(a, b, 1e-5), x.double(), weight.double())
    assert torch.equal(out, ref)
    for got, autograd, truth in ((dx, ref_dx, true_dx), (dw, ref_dw, true_dw)):
        assert got.dtype == torch.bfloat16
        err, ref_err = (got.double() - truth).abs(), (autograd.double() - truth).abs()
        assert err.max() <= ref_err.max() and err.mean() <= ref_err.mean()
        torch.testing.assert_close(got.double(), truth, rtol=2e-2, atol=2e-2)


def test_rms_norm_saves_its_input_and_rstd_only() -> None:
    x, weight = norm_inputs(torch.bfloat16)
    x.requires_grad_()
    saved = {}
    for name, fn in (("lean", rms_norm), ("autograd", rms_norm_reference)):
        recorder = SaveRecorder()
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            fn(x * 1, torch.nn.Parameter(weight), 1e-5)
        saved[name] = sum(r.nbytes for r in recorder.rows.values())
    rows = x.numel() // x.shape[-1]
    assert saved["lean"] == x.numel() * 2 + rows * 4  # bf16 input + fp32 rstd
    assert saved["autograd"] == 2 * x.numel() * 4 + x.numel() * 2 + rows * 4  # two fp32 copies, output, rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_bit_identical_to_autograd(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 9, 48, generator=g) * 4).to(dtype), torch.randn(4, 9, 48, generator=g).to(dtype)
    out, (da, db) = grads(silu_mul, a, b)
    ref, (ref_da, ref_db) = grads(lambda p, q: F.silu(p) * q, a, b)
    assert torch.equal(out, ref) and torch.equal(da, ref_da) and torch.equal(db, ref_db)
    recorder = SaveRecorder()
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        silu_mul(a.requires_grad_() * 1, b.requires_grad_() * 1)
    assert sum(r.nbytes for r in recorder.rows.values()) == 2 * a.numel() * a.element_size()  # a and b, no silu(a)


def tiny_model(lean: bool, seed: int = 0) -> torch.nn.Module:
    args = dataclasses.replace(FLAVORS["tiny"], n_layers=2, max_seq_len=32, lean_saves=lean)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)  # type: ignore[operator]
    return model


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]


def test_model_with_lean_saves_matches_autograd_saves() -> None:
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    lean_loss, lean_grads = loss_and_grads(tiny_model(True), tokens)
    ref_loss, ref_grads = loss_and_grads(tiny_model(False), tokens)
    assert torch.equal(lean_loss, ref_loss)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(lean_grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)


def test_lean_model_under_compile_matches_eager() -> None:
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grads = loss_and_grads(tiny_model(True), tokens)
    compiled = tiny_model(True)
    for name, block in list(compiled.layers.items()):  # type: ignore[operator]
        compiled.layers[name] = torch.compile(block, backend="aot_eager", fullgraph=True)  # type: ignore[index, operator]
    loss, got = loss_and_grads(compiled, tokens)
    got = {canonical_name(n): g for n, g in got.items()}
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    for name, ref in eager_grads.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_lean_model_under_activation_checkpointing_matches_no_ac(mode: str) -> None:
    from meshforge.config.schema import ActivationCheckpoint
    from meshforge.parallel.activation_ckpt import wrap_block

    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    plain_loss, plain_grads = loss_and_grads(tiny_model(True), tokens)
    model = tiny_model(True)
    ac = ActivationCheckpoint(mode=mode, selective_ac_option="op")  # type: ignore[arg-type]
    for i, (name, block) in enumerate(list(model.layers.items())):  # type: ignore[operator]
        model.layers[name] = wrap_block(block, ac, i)  # type: ignore[index, operator]
    loss, got = loss_and_grads(model, tokens)
    got = {canonical_name(n): g for n, g in got.items()}
    assert torch.equal(loss, plain_loss)
    for name, ref in plain_grads.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-8, msg=name)


def test_model_lean_saves_false_restores_autograd_saves() -> None:
    from meshforge.config.io import load_config
    from meshforge.model.hf_config import resolve_model_args

    for value, want in (("false", False), ("true", True)):
        cfg = load_config(None, ["--model.flavor", "tiny", "--model.lean_saves", value])
        args = resolve_model_args(cfg.model, 64)
        assert args.lean_saves is want
        block = build_model(dataclasses.replace(args, n_layers=1)).layers["0"]
        assert block.attention_norm.lean is want and block.feed_forward.lean is want  # type: ignore[union-attr]


def test_moe_experts_gate_is_bit_identical_with_lean_saves() -> None:
    from meshforge.model.moe import swiglu_grouped_mm, swiglu_loop

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 7, 1, 5])
    x = torch.randn(int(counts.sum()), 16, generator=g)
    ws = [torch.randn(5, 24, 16, generator=g), torch.randn(5, 16, 24, generator=g), torch.randn(5, 24, 16, generator=g)]
    for fn in (swiglu_grouped_mm, swiglu_loop):
        lean, ref = (grads(lambda *t, on=on, fn=fn: fn(*t, counts, on), x, *ws) for on in (True, False))  # type: ignore[misc]
        assert torch.equal(lean[0], ref[0]) and all(map(torch.equal, lean[1], ref[1]))
        recorder = SaveRecorder()
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            fn(x, *(w.requires_grad_() for w in ws), counts, True)
        assert "SiluBackward0" not in {row.made_by for row in recorder.rows.values()}
