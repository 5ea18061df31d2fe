"""Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm (head_dim decoupled from dim / n_heads): read from a
config.json, built, initialised, trained a step, counted exactly (the built model = param_counts; the planner's
per-rank parameters = the dry run's real sharding) and exchanged with Hugging Face's layout (an HF-style forward of
the export gives our logits; hand-built HF tensors land in the right parameters, permuted per head)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from test_hf_interop import hf_reference_logits

from meshforge.checkpoint import hf as hf_interop
from meshforge.config.io import load_config
from meshforge.model.flavors import ModelArgs, param_counts
from meshforge.model.hf_config import args_from_hf, read_hf_config
from meshforge.model.llama import Transformer, build_model
from meshforge.parallel.layout import check_tied_pipeline

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
QWEN3 = args_from_hf(read_hf_config(str(FIXTURES / "qwen3_tiny"))).with_seq_len(64)
QWEN2 = args_from_hf(read_hf_config(str(FIXTURES / "qwen2_tiny"))).with_seq_len(64)
BOTH = pytest.mark.parametrize("args", [QWEN3, QWEN2], ids=["qwen3", "qwen2"])
EXTRAS = (".bias", "q_norm.weight", "k_norm.weight")


def materialised(args: ModelArgs, seed: int = 0) -> Transformer:
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_configs_map_to_the_variants_and_build_them() -> None:
    assert QWEN3.qk_norm and not QWEN3.qkv_bias and QWEN3.head_dim == 32 != QWEN3.dim // QWEN3.n_heads
    assert QWEN2.qkv_bias and not QWEN2.qk_norm and QWEN2.head_dim == 16
    q3, q2 = build_model(QWEN3).layers["0"].attention, build_model(QWEN2).layers["0"].attention
    assert q3.q_norm.weight.shape == q3.k_norm.weight.shape == (32,)  # type: ignore[union-attr]
    assert q3.wq.weight.shape == (4 * 32, 64) and q3.wk.bias is None  # type: ignore[union-attr]
    assert (q2.wq.bias.shape, q2.wk.bias.shape, q2.wv.bias.shape) == ((64,), (32,), (32,))  # type: ignore[union-attr]
    assert q2.q_norm is None and q2.wo.bias is None  # type: ignore[union-attr]
    for args in (QWEN3, QWEN2):
        check_tied_pipeline(args, 1)  # no longer refused
        assert sum(p.numel() for p in build_model(args).parameters()) == param_counts(args).total


@BOTH
def test_one_training_step_moves_the_new_parameters(args: ModelArgs) -> None:
    model = materialised(args)
    new = {n: p for n, p in model.named_parameters() if n.endswith(EXTRAS)}
    assert len(new) == args.n_layers * (3 if args.qkv_bias else 2)
    for name, p in new.items():  # norms start at ones, biases at zeros (as HF initialises them)
        assert torch.equal(p, torch.ones_like(p) if "norm" in name else torch.zeros_like(p)), name
    before = {n: p.detach().clone() for n, p in new.items()}
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, p in new.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    optimizer.step()
    assert all(not torch.equal(p, before[n]) for n, p in new.items())


def randomised(args: ModelArgs, seed: int) -> Transformer:
    """A model whose biases and q/k norm weights are random (ones and zeros would hide a wrong layout) and whose
    attention is sharpened (at init it barely moves the logits)."""
    model = materialised(args, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attention.w" in name and name.endswith(".weight"):
                p.mul_(12.0)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


@BOTH
def test_hf_style_forward_of_the_export_gives_our_logits(tmp_path: Path, args: ModelArgs) -> None:
    model = randomised(args, seed=3)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf_interop.save_hf(weights, args, tmp_path, dtype="float32")
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens).double()
    want = hf_reference_logits(tmp_path, tokens)
    scale = want.abs().max()
    assert (ours - want).abs().max() < 1e-5 * scale, ((ours - want).abs().max(), scale)
    # the extras' own permutation is seen: wq / wk permuted, their biases and the norm weights written unpermuted
    hf = hf_interop.to_hf(weights, args, "float32")
    hf.update({hf_interop.hf_name(k): v for k, v in weights.items() if k.endswith(EXTRAS)})
    save_file(hf, str(tmp_path / "model.safetensors"))
    assert (hf_reference_logits(tmp_path, tokens) - ours).abs().max() > 0.05 * scale


@BOTH
def test_export_import_round_trip_is_exact(tmp_path: Path, args: ModelArgs) -> None:
    weights = {k: v.detach().clone() for k, v in randomised(args, seed=4).state_dict().items()}
    hf_interop.save_hf(weights, args, tmp_path, dtype="float32")
    assert args_from_hf(read_hf_config(str(tmp_path))).with_seq_len(64) == args  # config.json says Qwen2 / Qwen3
    back = hf_interop.load_hf(tmp_path, args)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    live = materialised(args, seed=9)
    hf_interop.load_hf_weights([live], tmp_path, args)  # straight into a model's parameters (initial_load_path)
    assert all(torch.equal(p, weights[n]) for n, p in live.named_parameters())


def interleaved(hf_rows: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rows of each head -> meshforge's interleaved ones: row 2i <- i, row 2i+1 <- i + head_dim / 2."""
    per_head = hf_rows.view(heads, 2, -1)
    return torch.stack([per_head[:, 0], per_head[:, 1]], dim=-1).reshape(-1)


def test_hand_built_hf_tensors_land_in_the_right_parameters(tmp_path: Path) -> None:
    args = replace(QWEN3, qkv_bias=True)  # both extras (Qwen3 with attention_bias)
    hf = hf_interop.to_hf({k: v.detach() for k, v in materialised(args).state_dict().items()}, args, "float32")
    hd, layer = args.head_dim, "model.layers.1.self_attn."
    named = {
        "q_norm.weight": torch.arange(hd, dtype=torch.float32),
        "k_norm.weight": 100 + torch.arange(hd, dtype=torch.float32),
        "q_proj.bias": 1000 + torch.arange(args.n_heads * hd, dtype=torch.float32),
        "k_proj.bias": 2000 + torch.arange(args.kv_heads * hd, dtype=torch.float32),
        "v_proj.bias": 3000 + torch.arange(args.kv_heads * hd, dtype=torch.float32),
    }
    hf.update({layer + k: v for k, v in named.items()})
    save_file(hf, str(tmp_path / "model.safetensors"))
    back = hf_interop.load_hf(tmp_path, args)
    ours = "layers.1.attention."
    assert back[ours + "q_norm.weight"][:4].tolist() == [0, hd // 2, 1, hd // 2 + 1]  # one head, interleaved
    assert torch.equal(back[ours + "k_norm.weight"], interleaved(named["k_norm.weight"], 1))
    assert torch.equal(back[ours + "wq.bias"], interleaved(named["q_proj.bias"], args.n_heads))
    assert torch.equal(back[ours + "wk.bias"], interleaved(named["k_proj.bias"], args.kv_heads))
    assert torch.equal(back[ours + "wv.bias"], named["v_proj.bias"])  # v is not rotated
    assert back["layers.0.attention.q_norm.weight"].eq(1).all()  # the other layer keeps its own


def test_planner_parameters_equal_the_dry_run_under_fsdp_and_tp() -> None:
    from meshforge.plan.layout import layout_args, layout_from_config
    from meshforge.plan.physics.parts import local_param_numel, rank_parts
    from meshforge.tools.dry_run import plan as dry_run

    for name in ("qwen3_tiny", "qwen2_tiny"):
        layout_flags = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
        cfg = load_config(None, ["--model.hf_config", str(FIXTURES / name), *layout_flags])
        layout = layout_from_config(cfg, 4)
        args = layout_args(layout)
        assert args.qk_norm == (name == "qwen3_tiny") and args.qkv_bias == (name == "qwen2_tiny")
        for rank in dry_run(cfg, 4).ranks:  # the real model on the meta device, sharded by the real code
            assert local_param_numel(args, layout, rank_parts(args, layout, rank.pp_rank)) == rank.param_elements
