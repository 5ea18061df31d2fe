"""Hugging Face names of the MoE parts (Qwen3-MoE layout; DeepSeek-V3's names for shared experts and the bias).

meshforge keeps each layer's routed experts as three 3-D tensors (experts, ...); HF stores one matrix per expert:

    layers.N.feed_forward.experts.w1[e]        <-> model.layers.N.mlp.experts.e.gate_proj.weight
    layers.N.feed_forward.experts.w3[e]        <-> model.layers.N.mlp.experts.e.up_proj.weight
    layers.N.feed_forward.experts.w2[e]        <-> model.layers.N.mlp.experts.e.down_proj.weight
    layers.N.feed_forward.router.gate.weight   <-> model.layers.N.mlp.gate.weight
    layers.N.feed_forward.shared_experts.wK    <-> model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight
    layers.N.feed_forward.expert_bias          <-> model.layers.N.mlp.gate.e_score_correction_bias (zeros if absent)

Dense layers of an MoE model keep the Llama names (mlp.gate_proj, ...). The exported config.json is a Qwen3-MoE one;
the qwen3_* flavors have its attention (head_dim 128, per-head q/k norms: checkpoint/hf_attention.py), the others
(DeepSeek shapes, debugmoe) have no q/k norms, so transformers' Qwen3-MoE would not load them as is (docs/moe.md).
"""

from __future__ import annotations

from typing import Any

import torch

from meshforge.model.flavors import ModelArgs

_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
LAYER_NAMES = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    **{f"feed_forward.shared_experts.{w}.weight": f"mlp.shared_experts.{p}.weight" for w, p in _PROJ.items()},
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
}
OPTIONAL_SUFFIX = "mlp.gate.e_score_correction_bias"


def expert_names(fqn: str, n_experts: int) -> list[str] | None:
    """HF names of the per-expert matrices of a 3-D expert weight (in expert order), None for other names."""
    parts = fqn.split(".")
    if len(parts) != 5 or parts[0] != "layers" or parts[2:4] != ["feed_forward", "experts"] or parts[4] not in _PROJ:
        return None
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{_PROJ[parts[4]]}.weight" for e in range(n_experts)]


def split_experts(names: list[str], tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """(experts, rows, cols) -> one (rows, cols) matrix per HF name."""
    return dict(zip(names, tensor.unbind(0), strict=True))


def moe_hf_config(args: ModelArgs) -> dict[str, Any]:
    """The Qwen3-MoE fields of config.json (plus DeepSeek's shared-expert count when there are shared experts)."""
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": args.n_routed_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "intermediate_size": args.dense_ffn_dim or args.ffn_hidden_dim,
        "norm_topk_prob": args.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.first_k_dense)),
        "router_aux_loss_coef": args.aux_loss_coeff,
        "output_router_logits": args.aux_loss_coeff > 0,  # transformers' switch for the auxiliary loss
    }
    if args.n_shared_experts:
        out["n_shared_experts"] = args.n_shared_experts
    return out
