"""Model shapes from a Hugging Face ``config.json`` or a ``[model]`` section's overrides, resolved to one ModelArgs.

Llama-family architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases),
Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim decoupled from hidden_size / heads) and Qwen3MoeForCausalLM (Qwen3's
attention, routed experts). Read with ``json``: nothing downloads. ``resolve_model_args`` is the one place a job's
shapes come from (training, dry run and planner).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshforge.errors import ConfigError
from meshforge.model.flavors import ModelArgs, get_flavor

if TYPE_CHECKING:
    from meshforge.config.schema import JobConfig, Model

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


def read_hf_config(path: str) -> dict[str, Any]:
    """The parsed config.json at ``path`` (a file or the folder holding it); ConfigError if absent or not JSON."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"model.hf_config = {path!r}: no such file; give a Hugging Face config.json or its folder")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.hf_config = {path!r} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.hf_config = {path!r} is not a JSON object")
    return data


def architecture(hf: dict[str, Any], source: str = "config.json") -> str:
    """The config's architecture, one of ARCHITECTURES; ConfigError naming the supported ones otherwise."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"model.hf_config = {source}: architecture {arch or 'missing'!r} is not supported; "
            f"use one of {', '.join(ARCHITECTURES)}"
        )
    return str(arch)


def args_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """The ModelArgs of a Hugging Face config dict (keys as transformers writes them)."""
    arch = architecture(hf, source)
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        base = ModelArgs(
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            vocab_size=int(hf["vocab_size"]),
            ffn_dim=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            max_seq_len=int(hf.get("max_position_embeddings", 8192)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            use_scaled_rope=False,
        )
        if arch == "Qwen3MoeForCausalLM":
            base = replace(base, **moe_fields(hf, base.n_layers, source))
    except KeyError as exc:
        raise ConfigError(f"model.hf_config = {source} lacks {exc.args[0]!r}; give a complete config.json") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // heads:
        base = replace(base, explicit_head_dim=int(head_dim))
    return _rope_scaling(base, hf.get("rope_scaling"), source)


def moe_fields(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """The MoE ModelArgs of a Qwen3-MoE config: softmax top-k routing (renormalised with norm_topk_prob), the dense
    layers (``mlp_only_layers``) a prefix of the stack, every other layer sparse (``decoder_sparse_step`` 1).

    Load balancing starts as transformers trains: the auxiliary loss only with ``output_router_logits`` (it is then
    meshforge's sequence-wise loss at ``router_aux_loss_coef``, not transformers' batch-wise one), no expert bias
    (``model.moe_load_balance_coeff`` turns it on)."""
    dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ConfigError(
            f"model.hf_config = {source}: mlp_only_layers = {dense} is not a prefix of the layers; only the first k "
            "layers can be dense here"
        )
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError(
            f"model.hf_config = {source}: decoder_sparse_step = {hf['decoder_sparse_step']} is not supported; "
            "only 1 (every layer after mlp_only_layers sparse)"
        )
    aux = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    return {
        "n_routed_experts": int(hf["num_experts"]),
        "top_k": int(hf["num_experts_per_tok"]),
        "moe_ffn_dim": int(hf["moe_intermediate_size"]),
        "n_shared_experts": int(hf.get("n_shared_experts", 0)),
        "route_norm": bool(hf.get("norm_topk_prob", False)),
        "first_k_dense": min(len(dense), n_layers),
        "aux_loss_coeff": aux,
    }


def _rope_scaling(args: ModelArgs, scaling: dict[str, Any] | None, source: str) -> ModelArgs:
    """Apply HF ``rope_scaling``: the llama3 type maps to meshforge's scaled RoPE; other types are refused."""
    if not scaling:
        return args
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ConfigError(
            f"model.hf_config = {source}: rope_scaling type {kind!r} is not supported (only llama3); "
            "remove rope_scaling or use a llama3-scaled config"
        )
    return replace(
        args,
        use_scaled_rope=True,
        rope_scaling_factor=float(scaling["factor"]),
        rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        rope_original_max_seq_len=int(scaling.get("original_max_position_embeddings", 8192)),
    )


_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "multiple_of", "vocab_size", "rope_theta")


def resolve_model_args(model: Model, seq_len: int) -> ModelArgs:
    """The shapes a job runs: ``model.hf_config`` when set, else the flavor, then each non-zero ``[model]`` shape
    field over it, at ``seq_len`` tokens."""
    if model.hf_config:
        args = args_from_hf(read_hf_config(model.hf_config), model.hf_config)
    else:
        args = get_flavor(model.flavor)
    for name in (*_OVERRIDES, "head_dim", "ffn_dim_multiplier", "rope_scaling_factor"):
        if getattr(model, name) < 0:
            raise ConfigError(f"model.{name} = {getattr(model, name)} must be > 0 (or 0 for the flavor's)")
    changes: dict[str, Any] = {name: getattr(model, name) for name in _OVERRIDES if getattr(model, name)}
    if model.ffn_dim_multiplier:
        changes.update(ffn_dim_multiplier=model.ffn_dim_multiplier, ffn_dim=None)
    if model.multiple_of and not model.ffn_dim:
        changes["ffn_dim"] = None
    if model.head_dim:
        changes["explicit_head_dim"] = model.head_dim
    if not model.lean_saves:
        changes["lean_saves"] = False
    if model.tie_embeddings != "auto":
        changes["tie_embeddings"] = model.tie_embeddings == "true"
    if model.rope_scaling_factor:
        changes.update(use_scaled_rope=model.rope_scaling_factor != 1.0, rope_scaling_factor=model.rope_scaling_factor)
    args = replace(args, **changes).with_seq_len(seq_len)
    if args.dim % args.n_heads and args.explicit_head_dim is None:
        raise ConfigError(f"model.dim = {args.dim} is not divisible by model.n_heads = {args.n_heads}; set head_dim")
    if args.n_heads % args.kv_heads:
        raise ConfigError(f"model.n_heads = {args.n_heads} is not divisible by model.n_kv_heads = {args.kv_heads}")
    return args


def model_label(model: Model) -> str:
    """What reports call the model: the flavor, or the HF config's folder name."""
    if not model.hf_config:
        return model.flavor
    path = Path(model.hf_config)
    return (path if path.is_dir() else path.parent).name or path.name


def model_args_for(cfg: JobConfig, vocab_size: int) -> ModelArgs:
    """The shapes a run builds (its flavor, hf_config and [model] overrides at its sequence length), checked
    against the tokenizer's vocabulary."""
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    if args.is_moe and cfg.model.moe_load_balance_coeff >= 0:
        args = replace(args, load_balance_coeff=cfg.model.moe_load_balance_coeff)
    if args.is_moe and cfg.model.moe_aux_loss_coeff >= 0:
        args = replace(args, aux_loss_coeff=cfg.model.moe_aux_loss_coeff)
    if vocab_size > args.vocab_size:
        raise ConfigError(
            f"the tokenizer {cfg.model.tokenizer_path} has {vocab_size} tokens but the model "
            f"({cfg.model.hf_config or cfg.model.flavor}) has vocab {args.vocab_size}; use a matching tokenizer"
        )
    return args
