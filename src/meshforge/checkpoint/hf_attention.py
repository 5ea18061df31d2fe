"""Hugging Face names and layout of the attention parameters, the Qwen variants' extras included.

    layers.N.attention.wq/wk/wv.bias        <-> model.layers.N.self_attn.q_proj/k_proj/v_proj.bias   (Qwen2)
    layers.N.attention.q_norm/k_norm.weight <-> model.layers.N.self_attn.q_norm/k_norm.weight        (Qwen3)

RoPE layout: meshforge rotates interleaved pairs (2i, 2i+1) of each head, HF's Llama / Qwen2 / Qwen3 rotate
(i, i + head_dim/2), so every tensor indexed by q or k's rows within a head is permuted per head on the way: the
wq / wk weights and biases (n_heads / kv_heads heads), and the per-head q / k norm weights (one head of head_dim:
the norm's mean over head_dim does not see the order, its weight must follow the rows). v's bias is not rotated.
"""

from __future__ import annotations

from typing import Any

from meshforge.model.flavors import ModelArgs

ATTENTION_NAMES = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def rope_heads(fqn: str, args: ModelArgs) -> int | None:
    """How many heads of RoPE-rotated rows the parameter ``fqn`` holds (its rows are permuted per head between the
    layouts); None for a parameter the layouts share as is."""
    if fqn.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if fqn.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.kv_heads
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def architecture_fields(args: ModelArgs) -> dict[str, Any]:
    """config.json's architecture fields for the attention this model has: Qwen3 with per-head q/k norms (biases as
    its ``attention_bias``), Qwen2 with q/k/v biases alone, Llama otherwise (MoE models override them:
    checkpoint/hf_moe.py)."""
    if args.qk_norm:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": args.qkv_bias}
    if args.qkv_bias:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False}
