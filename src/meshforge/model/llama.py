"""Llama 3 / 3.1 decoder: RMSNorm, RoPE with 3.1 frequency scaling, grouped-query attention via SDPA, SwiGLU; the
Qwen variants' attention too (Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm and decoupled head_dim).

Built on the meta device and materialised with ``to_empty`` + ``init_weights(seed)``. Initial values depend only on the
seed and each parameter's name, never on how the model is sharded, so every parallel layout starts from the same weights
as a single process (see ``init_weights``). Modules may be ``None`` (pipeline stages keep only their part).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.model.document_mask import DocumentMask, build_document_mask, masked_attention
from meshforge.model.flavors import ModelArgs
from meshforge.model.lean import rms_norm, rms_norm_reference, silu_mul
from meshforge.model.loss import chunked_cross_entropy
from meshforge.model.moe import MoE

try:  # torch's local tensors (meshforge train --local-ranks); a torch without them runs everything else
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode as one_draw
except ImportError:  # pragma: no cover - a torch without local tensors
    one_draw = contextlib.nullcontext  # type: ignore[assignment]

Projections = Callable[[torch.Tensor, list[nn.Linear]], tuple[torch.Tensor, ...]]
"""(input, linears) -> each linear's output: how a parallel layout applies linears sharing one input."""
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    """A parameter name with compile / checkpoint / FSDP wrapper prefixes removed."""
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim / 2,), with Llama 3.1 long-context scaling when ``use_scaled_rope``."""
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / args.head_dim))
    if not args.use_scaled_rope:
        return freqs
    factor, old_context = args.rope_scaling_factor, args.rope_original_max_seq_len
    low_freq_factor, high_freq_factor = args.rope_low_freq_factor, args.rope_high_freq_factor
    low_wavelen, high_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, (1 - smooth) * freqs / factor + smooth * freqs, scaled)


def rope_cache(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every position: (max_seq_len, head_dim) = cat(cos, sin) over the last dim."""
    freqs = rope_frequencies(args)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (batch, seq, heads, head_dim) by rope (seq, head_dim) or (batch, seq, head_dim)."""
    cos, sin = rope.chunk(2, dim=-1)  # (..., seq, head_dim / 2)
    if rope.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))  # (batch, seq, heads, head_dim / 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``lean``: saving the input and rstd only (model/lean.py)."""

    def __init__(self, dim: int, eps: float, lean: bool = True) -> None:
        super().__init__()
        self.eps, self.lean = eps, lean
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm if self.lean else rms_norm_reference)(x, self.weight, self.eps)


class CausalSDPA(nn.Module):
    """Causal attention core: q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim) -> like q.

    Grouped-query attention is the kernel's (``enable_gqa``), never a copy of K/V per query head. A module so context
    parallel can replace it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask = None) -> torch.Tensor:
        if mask is not None:  # training.document_mask: block-causal within each packed document
            return masked_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3: one RMSNorm over head_dim shared by every head of q (and one of k), applied before RoPE
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps, args.lean_saves) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps, args.lean_saves) if args.qk_norm else None
        self.sdpa = CausalSDPA()
        self.project: Projections | None = None
        """Set under sequence parallel: wq/wk/wv applied to the sequence shard (parallel/sequence_shard_saves.py)."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        linears = [self.wq, self.wk, self.wv]
        q, k, v = self.project(x, linears) if self.project is not None else (f(x) for f in linears)
        # -1 instead of the head count: under tensor parallelism each rank holds a slice of the heads
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:  # (batch, seq, heads, head_dim), per head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # grouped-query attention: k and v keep their kv heads, each shared by heads / kv_heads query heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.sdpa(q, k, v) if mask is None else self.sdpa(q, k, v, mask)  # (batch, heads, seq, head_dim)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU; ``lean``: the gate saves the two matmul outputs and recomputes silu in backward (model/lean.py)."""

    def __init__(self, dim: int, hidden_dim: int, lean: bool = True) -> None:
        super().__init__()
        self.lean = lean
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.project: Projections | None = None
        """Set under sequence parallel: w1/w3 applied to the sequence shard (parallel/sequence_shard_saves.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.project(x, [self.w1, self.w3]) if self.project is not None else (self.w1(x), self.w3(x))
        return self.w2(silu_mul(a, b) if self.lean else F.silu(a) * b)


def build_feed_forward(layer_id: int, args: ModelArgs) -> nn.Module:
    """Block ``layer_id``'s feed-forward: MoE where the flavor asks for it (model/moe.py), a dense SwiGLU otherwise."""
    if not args.is_moe:
        return FeedForward(args.dim, args.ffn_hidden_dim, args.lean_saves)
    if not args.is_moe_layer(layer_id):
        return FeedForward(args.dim, args.dense_ffn_dim or args.ffn_hidden_dim, args.lean_saves)
    hidden = args.moe_ffn_dim * args.n_shared_experts
    shared = FeedForward(args.dim, hidden, args.lean_saves) if args.n_shared_experts else None
    return MoE(args, shared)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.lean_saves)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.lean_saves)
        self.feed_forward = build_feed_forward(layer_id, args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask = None) -> torch.Tensor:
        masked = {} if mask is None else {"mask": mask}  # a keyword: TP's input plan covers (x, rope) only
        h = x + self.attention(self.attention_norm(x), rope, **masked)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab). Pipeline stages may hold a subset of the modules."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps, args.lean_saves)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:  # one Parameter under two names; named_parameters() yields it once (the embedding)
            self.output.weight = self.tok_embeddings.weight
        self.rope: torch.Tensor
        self.register_buffer("rope", rope_cache(args), persistent=False)
        self.document_mask = False
        """When set, (batch, seq) positions are in-document positions and attention stays within documents."""
        self.loss_chunks = 1
        """Token chunks of the loss computed in forward when labels are given (training.loss_chunks)."""

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: ids (batch, seq) on the first stage, hidden states (batch, seq, dim) after it.

        positions: the global position of each token (seq,) when the sequence is split (context parallel), or
        with ``document_mask`` each token's position in its document (batch, seq).
        labels: with ``loss_chunks`` > 1 the loss is returned instead of the logits (model/loss.py).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = tokens.shape[1]  # from the input, not h: under sequence parallel h may be a local shard
        rope = self.rope[:seq] if positions is None else self.rope[positions]
        mask = build_document_mask(positions) if self.document_mask and positions is not None else None
        for layer in self.layers.values():
            h = layer(h, rope) if mask is None else layer(h, rope, mask)
        h = self.norm(h) if self.norm is not None else h
        if labels is not None and self.output is not None:  # inside forward: FSDP has the output weight unsharded
            return chunked_cross_entropy(self.output, h, labels, self.loss_chunks)
        return self.output(h) if self.output is not None else h

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """nn.Module._apply, keeping a tied output projection tied (``to_empty`` gives every name a new Parameter)."""
        out = super()._apply(fn, recurse)
        tied = self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None
        if tied and self.output.weight is not self.tok_embeddings.weight:  # type: ignore[union-attr]
            self.output.weight = self.tok_embeddings.weight  # type: ignore[union-attr]
        return out

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer, independently of sharding: each tensor is drawn whole from a generator
        seeded by (seed, its canonical name), then each rank keeps its own DTensor shard of it."""
        self.rope.copy_(rope_cache(self.args, self.rope.device))
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()
        for name, param in self.named_parameters():
            fqn = canonical_name(name)
            with one_draw():  # --local-ranks: one draw of the seeded generator, not one per simulated rank
                full = initial_value(fqn, tuple(param.shape), self.args, seed, param.device)
            copy_into(param, full)


def initial_value(fqn: str, shape: tuple[int, ...], args: ModelArgs, seed: int, device: torch.device) -> torch.Tensor:
    """The initial value of one parameter, by name: normal(0.02) inputs, depth-scaled outputs, ones for norms (the
    per-head q/k norms too), zeros for the q/k/v biases."""
    if fqn.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if fqn.endswith(".bias"):
        return torch.zeros(shape, device=device)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    generator = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
    out = torch.empty(shape, device=gen_device)
    if fqn == "tok_embeddings.weight":  # tied: also the output projection, whose logits must start near ln(vocab):
        std, cutoff = (0.02 if args.tie_embeddings else 1.0), 3.0  # HF's initializer_range (dim^-0.5 copies the input)
    elif fqn == "output.weight":
        std, cutoff = args.dim**-0.5, 3.0
    elif fqn.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3")):
        layer_id = int(fqn.split(".")[1])
        std, cutoff = 0.02 / math.sqrt(2 * (layer_id + 1)), 2.0
    else:
        std, cutoff = 0.02, 2.0
    return truncated_normal_(out, std, cutoff, generator).to(device)


def truncated_normal_(out: torch.Tensor, std: float, cutoff: float, generator: torch.Generator) -> torch.Tensor:
    """Fill ``out`` with N(0, std^2) truncated to +-cutoff x std, by inverting the normal CDF of uniform samples: one
    pass (torch's trunc_normal_ with a generator resamples until every value lands, ~10x slower on a CPU)."""
    bound = math.erf(cutoff / math.sqrt(2.0))  # 2 Phi(x) - 1 at x = cutoff
    out.uniform_(-bound, bound, generator=generator).erfinv_().mul_(std * math.sqrt(2.0))
    return out.clamp_(-cutoff * std, cutoff * std)


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size value into a parameter, keeping only the local shard when it is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local.to(param.dtype))
    else:
        param.copy_(full.to(param.dtype))


def build_model(args: ModelArgs) -> Transformer:
    """The model on the meta device: no memory, ready for parallelisation, then ``to_empty`` + ``init_weights``."""
    with torch.device("meta"):
        return Transformer(args)
