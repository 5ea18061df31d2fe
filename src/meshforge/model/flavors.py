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

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times ffn_dim_multiplier, rounded up to multiple_of (Meta's formula)."""
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
    # Official shapes (Llama 3.2 1B/3B, Llama 3.1 8B/70B/405B); output projection untied
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256),
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
    """Exact parameter counts of the Llama 3 decoder built by meshforge.model.llama."""
    d, hd = args.dim, args.head_dim
    attn = d * args.n_heads * hd + 2 * d * args.kv_heads * hd + args.n_heads * hd * d
    ffn = 3 * d * args.ffn_hidden_dim
    norms = 2 * d
    return ParamCounts(
        embedding=args.vocab_size * d,
        per_layer=attn + ffn + norms,
        final_norm=d,
        output=d * args.vocab_size,
        n_layers=args.n_layers,
    )


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + 12 x layers x heads x head_dim x seq_len.

    This is the formula of the PaLM paper as TorchTitan applies it, so MFU is comparable with published numbers
    (the attention term counts the full, not causal-halved, score matrix).
    """
    counts = param_counts(args)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * counts.non_embedding + attention)


def model_args_for(cfg: JobConfig, vocab_size: int) -> ModelArgs:
    """The shapes a run builds: its flavor at its sequence length, checked against the tokenizer's vocabulary."""
    args = get_flavor(cfg.model.flavor).with_seq_len(cfg.training.seq_len)
    if vocab_size > args.vocab_size:
        raise ConfigError(
            f"the tokenizer {cfg.model.tokenizer_path} has {vocab_size} tokens but model.flavor = {cfg.model.flavor} "
            f"has vocab {args.vocab_size}; use a matching tokenizer or flavor"
        )
    return args
