"""Llama 3 / 3.1 model shapes ("flavors") and the arithmetic every tool shares: parameter counts and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.config.schema import JobConfig


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama 3 decoder."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    """The output projection is the token embedding's weight (Llama 3.2 1B/3B)."""
    explicit_head_dim: int | None = None
    """Head width when it is not dim / n_heads (Qwen3)."""
    ffn_dim: int | None = None
    """SwiGLU width given directly (Hugging Face intermediate_size) instead of by multiplier and multiple_of."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    rope_scaling_factor: float = 8.0
    """Llama 3 RoPE scaling (used when use_scaled_rope): factor, low/high frequency factors, original context."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: ffn_dim when given, else 2/3 of 4*dim, times ffn_dim_multiplier, rounded up to multiple_of
        (Meta's formula)."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_seq_len(self, seq_len: int) -> ModelArgs:
        return replace(self, max_seq_len=seq_len)


FLAVORS: dict[str, ModelArgs] = {
    # CPU flavors for fast tests and benchmarks (vocab 2048 = the shipped Austen tokenizer)
    "tiny": ModelArgs(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=32),
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256),
    "100m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=2048, multiple_of=256),
    # Official shapes: Llama 3.2 1B/3B (output tied to the embedding, RoPE scaled by 32), Llama 3.1 8B/70B/405B
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        tie_embeddings=True,
        rope_scaling_factor=32.0,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        tie_embeddings=True,
        rope_scaling_factor=32.0,
    ),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    # 8B-shaped blocks, 4 of them: a single-GPU check of 8B kernels, memory per layer and MFU
    "8B_4layers": ModelArgs(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096),
}


def get_flavor(name: str) -> ModelArgs:
    """The ModelArgs of a named flavor; ValueError naming the choices otherwise."""
    if name not in FLAVORS:
        raise ConfigError(f"model.flavor = {name!r} is unknown; choose one of {', '.join(FLAVORS)}")
    return FLAVORS[name]


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a flavor, by part."""

    embedding: int
    per_layer: int
    final_norm: int
    output: int
    n_layers: int

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.n_layers + self.final_norm + self.output

    @property
    def non_embedding(self) -> int:
        """All but the token embedding (the output projection is a matmul and counts), as TorchTitan counts."""
        return self.total - self.embedding


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact parameter counts of the decoder built by meshforge.model.llama; a tied output projection counts once
    (as the embedding), q/k/v biases and per-head q/k norms count in their layer."""
    d, hd = args.dim, args.head_dim
    attn = d * args.n_heads * hd + 2 * d * args.kv_heads * hd + args.n_heads * hd * d
    if args.qkv_bias:
        attn += (args.n_heads + 2 * args.kv_heads) * hd
    if args.qk_norm:
        attn += 2 * hd
    ffn = 3 * d * args.ffn_hidden_dim
    norms = 2 * d
    return ParamCounts(
        embedding=args.vocab_size * d,
        per_layer=attn + ffn + norms,
        final_norm=d,
        output=0 if args.tie_embeddings else d * args.vocab_size,
        n_layers=args.n_layers,
    )


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + 12 x layers x heads x head_dim x seq_len.

    This is the formula of the PaLM paper as TorchTitan applies it, so MFU is comparable with published numbers
    (the attention term counts the full, not causal-halved, score matrix).
    """
    counts = param_counts(args)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    tied_output = counts.embedding if args.tie_embeddings else 0  # a tied output projection is still a matmul
    return float(6 * (counts.non_embedding + tied_output) + attention)


def model_args_for(cfg: JobConfig, vocab_size: int) -> ModelArgs:
    """The shapes a run builds (its flavor, hf_config and [model] overrides at its sequence length), checked
    against the tokenizer's vocabulary."""
    from meshforge.model.hf_config import resolve_model_args

    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    if vocab_size > args.vocab_size:
        raise ConfigError(
            f"the tokenizer {cfg.model.tokenizer_path} has {vocab_size} tokens but the model "
            f"({cfg.model.hf_config or cfg.model.flavor}) has vocab {args.vocab_size}; use a matching tokenizer"
        )
    return args
