"""Hugging Face interop of MoE weights: the Qwen3-MoE layout (one matrix per expert), exact round trips."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshforge.checkpoint import hf as hf_interop
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model

ARGS = get_flavor("debugmoe")


def weights(seed: int = 3) -> dict[str, torch.Tensor]:
    model = build_model(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_experts_export_one_matrix_each_and_round_trip(tmp_path: Path) -> None:
    w = weights()
    hf_interop.save_hf(w, ARGS, tmp_path, "float32")
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "model.safetensors"))
    for e in range(ARGS.n_routed_experts):
        got = raw[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(got, w["layers.2.feed_forward.experts.w2"][e])  # (dim, hidden) of expert e
    assert torch.equal(raw["model.layers.1.mlp.gate.weight"], w["layers.1.feed_forward.router.gate.weight"])
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in raw
    assert "model.layers.0.mlp.gate_proj.weight" in raw  # the dense first layer keeps the Llama names
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 8 and cfg["mlp_only_layers"] == [0]
    back = hf_interop.load_hf(tmp_path, ARGS)
    for key, value in w.items():
        assert torch.equal(back[key], value), key
    biases = [k for k in back if k.endswith("expert_bias")]  # buffers: zeros when the file has none
    assert len(biases) == 3 and all(not back[k].any() for k in biases)


def test_missing_expert_is_named(tmp_path: Path) -> None:
    hf = hf_interop.to_hf(weights(), ARGS, "float32")
    del hf["model.layers.3.mlp.experts.5.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(hf, str(tmp_path / "model.safetensors"))
    try:
        hf_interop.load_hf(tmp_path, ARGS)
    except ValueError as exc:
        assert "model.layers.3.mlp.experts.5.up_proj.weight" in str(exc)
    else:
        raise AssertionError("a missing expert matrix was not reported")


def test_qwen3_moe_attention_round_trips(tmp_path: Path) -> None:
    """A Qwen3-MoE-shaped model (head_dim decoupled, per-head q/k norms): the norms export under HF's names, the
    config.json reads back as the same shapes, and the weights return exactly."""
    from dataclasses import replace

    from meshforge.model.hf_config import args_from_hf, read_hf_config

    args = replace(ARGS, qk_norm=True, explicit_head_dim=64, load_balance_coeff=0.0)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(5)
    with torch.no_grad():  # norms start at ones: make their entries differ so a permutation would show
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    w = {k: v.detach().clone() for k, v in model.named_parameters()}
    hf_interop.save_hf(w, args, tmp_path, "float32")
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "model.safetensors"))
    assert raw["model.layers.2.self_attn.q_norm.weight"].shape == (64,)
    assert not torch.equal(raw["model.layers.2.self_attn.k_norm.weight"], w["layers.2.attention.k_norm.weight"])
    back_args = args_from_hf(read_hf_config(str(tmp_path)))
    assert back_args.qk_norm and back_args.head_dim == 64 and back_args.n_routed_experts == ARGS.n_routed_experts
    back = hf_interop.load_hf(tmp_path, back_args)
    assert all(torch.equal(back[k], v) for k, v in w.items())
