"""Llama 3 / 3.1 model shapes ("flavors") and the arithmetic every tool shares: parameter counts and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshforge.errors import ConfigError


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
    lean_saves: bool = True
    """RMSNorm and SwiGLU save only what backward needs without recomputing a matmul (model/lean.py), and under
    sequence parallel the column-parallel matmuls save the sequence shard (parallel/sequence_shard_saves.py); False:
    the op-by-op saves of torch autograd and DTensor (the reference of the parity tests)."""
    rope_scaling_factor: float = 8.0
    """Llama 3 RoPE scaling (used when use_scaled_rope): factor, low/high frequency factors, original context."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # Mixture of experts (model/moe.py); n_routed_experts = 0 keeps every feed-forward dense
    n_routed_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = 1
    """Routed experts per token."""
    n_shared_experts: int = 0
    """Always-on experts per MoE layer (fused into one SwiGLU of width n_shared_experts x moe_ffn_dim)."""
    moe_ffn_dim: int = 0
    """Hidden width of one expert's SwiGLU."""
    first_k_dense: int = 0
    """The first k layers keep a dense feed-forward (ffn_hidden_dim, or dense_ffn_dim when set)."""
    dense_ffn_dim: int = 0
    """Width of the dense layers of an MoE model (0: ffn_hidden_dim)."""
    score_func: str = "softmax"
    """Router scores: softmax (over experts) or sigmoid (per expert)."""
    route_norm: bool = False
    """Renormalise the top-k scores of a token to sum to 1."""
    route_scale: float = 1.0
    """Multiplier of the routed experts' combined output (DeepSeek-V3: 2.5)."""
    n_expert_groups: int = 1
    """Node-limited routing: experts split into this many groups ..."""
    n_limited_groups: int = 1
    """... of which each token may use the n_limited_groups best (by the sum of their top-2 scores)."""
    load_balance_coeff: float = 0.0
    """Auxiliary-loss-free balancing: bias += coeff x sign(mean load - load) per step (0: off)."""
    aux_loss_coeff: float = 0.0
    """Sequence-wise auxiliary balance loss weight (DeepSeek-V3 eq. 17-20; 0: off)."""

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has an MoE feed-forward (the first first_k_dense layers stay dense)."""
        return self.is_moe and layer_id >= self.first_k_dense

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
# Mixture-of-experts shapes (model/moe.py). DeepSeek's attention is this project's GQA (head_dim = dim / n_heads), not
# MLA; Qwen3's is the published one (head_dim 128, per-head q/k RMSNorm). Everything else is the published config
# (docs/moe.md and tests/unit/test_moe.py give the exact differences in parameter count).
FLAVORS.update(
    {
        # CPU MoE: ~7.7M parameters, 8 experts, top-2, one shared expert, the first layer dense
        "debugmoe": ModelArgs(
            dim=256,
            n_layers=4,
            n_heads=8,
            n_kv_heads=4,
            vocab_size=2048,
            multiple_of=256,
            n_routed_experts=8,
            top_k=2,
            n_shared_experts=1,
            moe_ffn_dim=256,
            first_k_dense=1,
            route_norm=True,
            load_balance_coeff=1e-3,
        ),
        # debugmoe's dense twin: same attention, a dense SwiGLU of 768 in every layer = debugmoe's active width
        # (shared 256 + top-2 x 256); the comparison of docs/benchmarks/moe.md
        "debugmoe_dense": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=256),
        # TorchTitan's DeepSeek-V3 "16B" (= DeepSeek-V2-Lite's shape); multi-head attention in place of MLA
        "deepseek_v3_16B": ModelArgs(
            dim=2048,
            n_layers=27,
            n_heads=16,
            n_kv_heads=16,
            vocab_size=102400,
            rope_theta=10000.0,
            use_scaled_rope=False,
            max_seq_len=4096,
            n_routed_experts=64,
            top_k=6,
            n_shared_experts=2,
            moe_ffn_dim=1408,
            first_k_dense=1,
            dense_ffn_dim=10944,
            load_balance_coeff=1e-3,
        ),
        # DeepSeek-V3 671B: sigmoid scores, bias-corrected top-8 of 256 within 4 of 8 groups, scale 2.5; GQA kv 8
        "deepseek_v3_671B": ModelArgs(
            dim=7168,
            n_layers=61,
            n_heads=128,
            n_kv_heads=8,
            vocab_size=129280,
            rope_theta=10000.0,
            use_scaled_rope=False,
            max_seq_len=4096,
            n_routed_experts=256,
            top_k=8,
            n_shared_experts=1,
            moe_ffn_dim=2048,
            first_k_dense=3,
            dense_ffn_dim=18432,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            n_expert_groups=8,
            n_limited_groups=4,
            load_balance_coeff=1e-3,
        ),
        "qwen3_30B_A3B": ModelArgs(
            dim=2048,
            n_layers=48,
            n_heads=32,
            n_kv_heads=4,
            explicit_head_dim=128,
            qk_norm=True,
            vocab_size=151936,
            norm_eps=1e-6,
            rope_theta=1e6,
            use_scaled_rope=False,
            max_seq_len=4096,
            n_routed_experts=128,
            top_k=8,
            moe_ffn_dim=768,
            route_norm=True,
            load_balance_coeff=1e-3,
        ),
        "qwen3_235B_A22B": ModelArgs(
            dim=4096,
            n_layers=94,
            n_heads=64,
            n_kv_heads=4,
            explicit_head_dim=128,
            qk_norm=True,
            vocab_size=151936,
            norm_eps=1e-6,
            rope_theta=1e6,
            use_scaled_rope=False,
            max_seq_len=4096,
            n_routed_experts=128,
            top_k=8,
            moe_ffn_dim=1536,
            route_norm=True,
            load_balance_coeff=1e-3,
        ),
    }
)


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
    moe_total: int = 0
    """MoE models: parameters of the dense layers' FFNs and the MoE layers' routers, shared and routed experts (the
    per_layer count is then attention + norms only)."""
    moe_active: int = 0
    """The same with routed experts counted top_k / n_experts: what one token uses (TorchTitan's convention)."""

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.n_layers + self.moe_total + self.final_norm + self.output

    @property
    def active(self) -> int:
        """Parameters one token uses (all of them for a dense model)."""
        return self.total - self.moe_total + self.moe_active

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
    moe_total = moe_active = 0
    if args.is_moe:
        ffn = 0
        dense = 3 * d * (args.dense_ffn_dim or args.ffn_hidden_dim) * args.first_k_dense
        expert = 3 * d * args.moe_ffn_dim
        common = args.n_routed_experts * d + args.n_shared_experts * expert  # router + shared experts
        n_moe = args.n_layers - args.first_k_dense
        moe_total = dense + n_moe * (common + args.n_routed_experts * expert)
        moe_active = dense + n_moe * (common + args.top_k * expert)
    return ParamCounts(
        embedding=args.vocab_size * d,
        per_layer=attn + ffn + norms,
        final_norm=d,
        output=0 if args.tie_embeddings else d * args.vocab_size,
        n_layers=args.n_layers,
        moe_total=moe_total,
        moe_active=moe_active,
    )


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + 12 x layers x heads x head_dim x seq_len.

    This is the formula of the PaLM paper as TorchTitan applies it, so MFU is comparable with published numbers
    (the attention term counts the full, not causal-halved, score matrix). MoE models count the parameters a token
    uses: routers, shared experts and top_k / n_experts of the routed experts (TorchTitan's convention).
    """
    counts = param_counts(args)
    tied_output = counts.embedding if args.tie_embeddings else 0  # a tied output projection is still a matmul
    return float(6 * (counts.active - counts.embedding + tied_output) + attention_flops_per_token(args, seq_len))


MFU_LABEL = "MFU (TorchTitan convention, attention counted in full)"
"""What ``mfu_pct`` is, wherever it is printed: tokens/s x ``flops_per_token`` / peak."""
MFU_CAUSAL_LABEL = "MFU (causal, attention halved, Megatron-Bridge convention)"
"""What ``mfu_causal_pct`` is: tokens/s x ``causal_flops_per_token`` / the same peak."""


def attention_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """The score-matrix term of ``flops_per_token``, counted in full: 12 x layers x heads x head_dim x seq_len
    (forward QK^T and PV, 2 x 2 x heads x head_dim x seq_len per layer, times 3 for forward + backward)."""
    return float(12 * args.n_layers * args.n_heads * args.head_dim * seq_len)


def causal_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """``flops_per_token`` with the attention term halved (a causal kernel skips the masked half of the score
    matrix): the convention of Megatron-Bridge's MFU. Only the attention term is halved; the 6 x parameters stay."""
    return flops_per_token(args, seq_len) - attention_flops_per_token(args, seq_len) / 2
