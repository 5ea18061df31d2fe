"""Hugging Face interop: the q/k RoPE permutation checked numerically against an HF-style Llama forward written
here (rotate_half RoPE, read from the exported safetensors + config.json); name mapping and conversion round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshforge.checkpoint import hf as hf_interop
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model

ARGS = get_flavor("tiny").with_seq_len(64)


def model_weights(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = build_model(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_inv_freq(cfg: dict) -> torch.Tensor:
    """transformers' default + llama3 rope initialisation, from config.json."""
    dim = cfg["head_dim"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg["rope_scaling"]
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    llama = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, llama)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def hf_projection(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, heads: int, hd: int) -> torch.Tensor:
    """(batch, seq, dim) -> (batch, seq, heads, head_dim): x W^T, plus the bias when the file has one (Qwen2)."""
    out = x @ w[f"{name}.weight"].T
    if f"{name}.bias" in w:
        out = out + w[f"{name}.bias"]
    return out.view(*x.shape[:2], heads, hd)


def hf_reference_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's forward, in float64, from an HF folder: rotate_half RoPE, explicit causal softmax; with
    Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm (after the projection, before RoPE) when the file has them."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    heads, kv_heads, hd, eps = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["rms_norm_eps"],
    )
    batch, seq = tokens.shape
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), hf_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = hf_projection(x, w, p + "self_attn.q_proj", heads, hd)
        k = hf_projection(x, w, p + "self_attn.k_proj", kv_heads, hd)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: per head, over head_dim
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = hf_projection(x, w, p + "self_attn.v_proj", kv_heads, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
        h = h + attn.transpose(1, 2).reshape(batch, seq, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def test_hf_layout_gives_our_logits(tmp_path: Path) -> None:
    model, _ = model_weights(seed=3)
    with torch.no_grad():  # attention at init barely moves the logits: sharpen it so the layout matters
        for name, param in model.named_parameters():
            if "attention.w" in name:
                param.mul_(12.0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf_interop.save_hf(weights, ARGS, tmp_path, dtype="float32")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens).double()
    want = hf_reference_logits(tmp_path, tokens)
    scale = want.abs().max()
    assert (ours - want).abs().max() < 1e-5 * scale, ((ours - want).abs().max(), scale)
    # without the q/k permutation the HF-style attention gives other logits: the test sees the layout
    raw = {hf_interop.hf_name(k): v for k, v in weights.items()}
    save_file(raw, str(tmp_path / "model.safetensors"))
    assert (hf_reference_logits(tmp_path, tokens) - ours).abs().max() > 0.05 * scale


def test_permutations_are_inverse() -> None:
    w = torch.randn(ARGS.n_heads * ARGS.head_dim, ARGS.dim)
    assert torch.equal(hf_interop.permute_from_hf(hf_interop.permute_to_hf(w, ARGS.n_heads), ARGS.n_heads), w)
    assert not torch.equal(hf_interop.permute_to_hf(w, ARGS.n_heads), w)


def test_safetensors_round_trip_is_exact(tmp_path: Path) -> None:
    _, weights = model_weights(seed=4)
    hf_interop.save_hf(weights, ARGS, tmp_path, dtype="float32")
    back = hf_interop.load_hf(tmp_path, ARGS)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.layers.7.self_attn.q_proj.weight" in names and "lm_head.weight" in names


def test_checkpoint_conversion_round_trip(tmp_path: Path) -> None:
    _, weights = model_weights(seed=5)
    hf_interop.save_hf(weights, ARGS, tmp_path / "hf", dtype="float32")
    assert hf_interop.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--flavor", "tiny"]) == 0
    model, manifest = hf_interop.read_checkpoint_model(tmp_path / "ckpt")
    assert manifest is not None and manifest["model_only"] and manifest["step"] == 0
    assert all(torch.equal(model[k], weights[k]) for k in weights)
    assert hf_interop.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    first, second = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert hf_interop.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "bf16")]) == 0
    assert load_file(tmp_path / "bf16/model.safetensors")["lm_head.weight"].dtype == torch.bfloat16


def test_tied_embeddings_fill_the_output(tmp_path: Path) -> None:
    _, weights = model_weights(seed=6)
    hf = hf_interop.to_hf(weights, ARGS, "float32")
    del hf["lm_head.weight"]
    save_file(hf, str(tmp_path / "model.safetensors"))
    assert torch.equal(hf_interop.load_hf(tmp_path, ARGS)["output.weight"], weights["tok_embeddings.weight"])


def test_mismatched_weights_fail_in_one_line(tmp_path: Path) -> None:
    _, weights = model_weights(seed=7)
    hf_interop.save_hf(weights, ARGS, tmp_path, dtype="float32")
    with pytest.raises(ValueError, match=r"config.json does not describe this model.flavor: hidden_size 64 vs 256"):
        hf_interop.load_hf(tmp_path, get_flavor("debugmodel"))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"shape model.embed_tokens.weight \(2048, 64\) vs model \(2048, 256\)"):
        hf_interop.load_hf(tmp_path, get_flavor("debugmodel"))
    hf = hf_interop.to_hf(weights, ARGS, "float32")
    del hf["model.layers.3.mlp.up_proj.weight"]
    save_file(hf, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing model.layers.3.mlp.up_proj.weight"):
        hf_interop.load_hf(tmp_path, ARGS)


def test_export_streams_tensor_by_tensor_into_bounded_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    _, weights = model_weights(seed=8)
    hf_interop.save_hf(weights, ARGS, tmp_path / "hf", dtype="float32")
    assert hf_interop.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--flavor", "tiny"]) == 0
    loaded: list[int] = []
    real_load = dcp.load

    def load(state_dict: dict[str, Any], **kwargs: Any) -> None:
        loaded.append(len(state_dict["model"]))
        real_load(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "load", load)
    out = tmp_path / "out"
    argv = ["to-hf", str(tmp_path / "ckpt"), str(out), "--dtype", "float32", "--max-shard-mib", "1"]
    assert hf_interop.main(argv) == 0
    assert loaded == [1] * len(weights)  # one tensor per read: the full model is never in memory
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 1 and all(f.stat().st_size <= 2**20 + 2**14 for f in files)  # + the safetensors header
    assert (out / "model.safetensors.index.json").is_file()
    back = hf_interop.load_hf(out, ARGS)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
