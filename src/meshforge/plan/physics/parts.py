"""What a rank holds and computes: parameters counted shape by shape, per part of the model, with the real sharding
rules; the model as a token runs it (``compute_view``). Pure Python. Its bytes per token and the step's peak are
plan/physics/memory.py and plan/physics/peak.py; its time is plan/physics/estimate.py.

Parameters are counted shape by shape with the real sharding rules, so the analytical figure equals what FSDP2 +
tensor parallel allocate on rank 0 (tests/unit/test_plan_exact.py checks this against a fake process group):
TP shards wq/wk/wv/w1/w3/output on dim 0 (colwise), wo/w2 on dim 1 (rowwise), the embedding on dim 0 (vocab);
FSDP2 then chunks each TP-local tensor on dim 0 over dp_shard x cp ranks, rank 0 holding ceil(rows / n) rows.

MoE flavors: the first first_k_dense blocks have a dense SwiGLU of dense_ffn_dim; the others hold attention, a router
(replicated under TP), shared experts (split like a dense FFN) and the routed experts, which TP leaves whole and which
FSDP chunks on the expert dim over dp_shard x cp, or, under expert parallel, which each rank holds E / ep of, chunked
on their dim 1 over efsdp = dp_shard x cp / ep (parallel/expert_parallel.py, parallel/fsdp.py). Compute and
activations use ``compute_view``: the model with its FFN width set to what a token runs (the active parameters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from meshforge.model.flavors import ModelArgs
from meshforge.plan.layout import Layout, stage_layer_counts, stages_of_rank

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_LOAD = 1.25
"""MoE under expert parallel: rows the busiest rank's experts receive over the mean. Its routed compute and saved
activations are sized for this (the imbalance headroom) since the step waits for it; without EP every rank runs its
own tokens' experts and the load is even across ranks. An assumption, not a measurement (plan/physics/moe.py's
default)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape and the dim tensor parallel shards (None: replicated)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None


@functools.lru_cache(maxsize=64)
def block_params(args: ModelArgs) -> tuple[ParamSpec, ...]:
    """The parameters of one transformer block, as meshforge.model.llama builds them."""
    d, q, kv, f = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    extra: tuple[ParamSpec, ...] = ()
    if args.qkv_bias:  # sharded like their projections' rows
        extra += tuple(ParamSpec(f"attention.{w}.bias", (n,), 0) for w, n in (("wq", q), ("wk", kv), ("wv", kv)))
    if args.qk_norm:
        extra += tuple(ParamSpec(f"attention.{w}_norm.weight", (args.head_dim,), None) for w in ("q", "k"))
    return (
        *extra,
        ParamSpec("attention_norm.weight", (d,), None),
        ParamSpec("attention.wq.weight", (q, d), 0),
        ParamSpec("attention.wk.weight", (kv, d), 0),
        ParamSpec("attention.wv.weight", (kv, d), 0),
        ParamSpec("attention.wo.weight", (d, q), 1),
        ParamSpec("ffn_norm.weight", (d,), None),
        ParamSpec("feed_forward.w1.weight", (f, d), 0),
        ParamSpec("feed_forward.w2.weight", (d, f), 1),
        ParamSpec("feed_forward.w3.weight", (f, d), 0),
    )


def embedding_params(args: ModelArgs) -> tuple[ParamSpec, ...]:
    return (ParamSpec("tok_embeddings.weight", (args.vocab_size, args.dim), 0),)


def head_params(args: ModelArgs) -> tuple[ParamSpec, ...]:
    if args.tie_embeddings:  # the output projection is the embedding's weight, counted there
        return (ParamSpec("norm.weight", (args.dim,), None),)
    return (ParamSpec("norm.weight", (args.dim,), None), ParamSpec("output.weight", (args.vocab_size, args.dim), 0))


@functools.lru_cache(maxsize=64)
def dense_view(args: ModelArgs) -> ModelArgs:
    """An MoE model's dense blocks (the first first_k_dense) as a dense model's block."""
    return replace(args, n_routed_experts=0, ffn_dim=args.dense_ffn_dim or args.ffn_hidden_dim)


@functools.lru_cache(maxsize=64)
def moe_block_params(args: ModelArgs) -> tuple[ParamSpec, ...]:
    """An MoE block's parameters but the routed experts: attention, norms, the router, the shared experts."""
    attention = tuple(p for p in block_params(args) if not p.name.startswith("feed_forward."))
    d, s = args.dim, args.n_shared_experts * args.moe_ffn_dim
    router = ParamSpec("feed_forward.router.gate.weight", (args.n_routed_experts, d), None)
    if not s:
        return (*attention, router)
    shared = tuple(
        ParamSpec(f"feed_forward.shared_experts.{w}.weight", shape, dim)
        for w, shape, dim in (("w1", (s, d), 0), ("w2", (d, s), 1), ("w3", (s, d), 0))
    )
    return (*attention, router, *shared)


def routed_numel(args: ModelArgs, fsdp: int, ep: int) -> int:
    """Rank 0's routed-expert elements of one MoE block (w1, w3: (E, h, d); w2: (E, d, h); never TP-split):
    ep 1: FSDP chunks dim 0 (the experts) over dp_shard x cp; ep > 1: E / ep experts chunked on dim 1 over efsdp."""
    e, h, d = args.n_routed_experts, args.moe_ffn_dim, args.dim
    if ep == 1:
        return 3 * -(-e // fsdp) * h * d
    efsdp = fsdp // ep
    return e // ep * (2 * -(-h // efsdp) * d + -(-d // efsdp) * h)


@functools.lru_cache(maxsize=4096)
def moe_block_numel(args: ModelArgs, tp: int, fsdp: int, ep: int) -> int:
    """Rank 0's elements of one MoE block under TP x FSDP x EP (fsdp = dp_shard x cp, as for every parameter)."""
    return sum(shard_numel(p, tp, fsdp) for p in moe_block_params(args)) + routed_numel(args, fsdp, ep)


def moe_block_full_numel(args: ModelArgs, tp: int, ep: int) -> int:
    """Elements of one MoE block's FSDP-gathered weights: TP-local, routed experts E / ep of them whole."""
    return sum(full_numel(p, tp) for p in moe_block_params(args)) + routed_numel(args, ep, ep)


def blocks_numel(args: ModelArgs, layout: Layout, parts: RankParts, fsdp: int) -> int:
    """Rank 0's elements of a pipeline rank's blocks, chunked over ``fsdp`` ranks (1: gathered, as FSDP all-gathers
    them; experts E / ep under EP)."""
    tp = layout.tp
    if not args.is_moe:
        return parts.layers * part_numel(args, "block", tp, fsdp)
    dense = (parts.layers - parts.moe_layers) * part_numel(dense_view(args), "block", tp, fsdp)
    if fsdp == 1:
        return dense + parts.moe_layers * moe_block_full_numel(args, tp, layout.ep)
    return dense + parts.moe_layers * moe_block_numel(args, tp, fsdp, layout.ep)


@functools.lru_cache(maxsize=256)
def compute_view(args: ModelArgs, tp: int, ep: int) -> ModelArgs:
    """What one block computes per token on one TP rank, as a dense model: an MoE flavor's FFN width becomes the
    per-layer mean of the dense blocks' width and the MoE blocks' shared + top_k routed widths. TP ranks each run
    the routed experts on the whole sequence (x tp), the busiest EP rank on MAX_LOAD x the mean rows. The router
    and the token shuffles are left out. Dense flavors: ``args`` itself."""
    if not args.is_moe:
        return args
    load = MAX_LOAD if ep > 1 else 1.0
    moe_width = args.n_shared_experts * args.moe_ffn_dim + tp * load * args.top_k * args.moe_ffn_dim
    dense = args.first_k_dense * (args.dense_ffn_dim or args.ffn_hidden_dim)
    width = (dense + (args.n_layers - args.first_k_dense) * moe_width) / args.n_layers
    return replace(args, ffn_dim=round(width))  # keeps the MoE fields: estimate.layer_times reads them


def routed_width_per_token(args: ModelArgs, ep: int) -> float:
    """Of compute_view's FFN width, the routed experts' share on one TP rank (mean over the blocks)."""
    load = MAX_LOAD if ep > 1 else 1.0
    return (args.n_layers - args.first_k_dense) / args.n_layers * load * args.top_k * args.moe_ffn_dim


@functools.lru_cache(maxsize=4096)
def part_numel(args: ModelArgs, part: str, tp: int, fsdp: int) -> int:
    """Rank 0's elements of one block / the embedding / the head (norm + output) under TP x FSDP."""
    parts: dict[str, Callable[[ModelArgs], tuple[ParamSpec, ...]]] = {
        "block": block_params,
        "embedding": embedding_params,
        "head": head_params,
    }
    return sum(shard_numel(p, tp, fsdp) for p in parts[part](args))


def shard_numel(spec: ParamSpec, tp: int, fsdp: int) -> int:
    """Elements rank 0 holds: the TP-local tensor, chunked on dim 0 over the FSDP ranks (rank 0: ceil(rows / n))."""
    shape = list(spec.shape)
    if tp > 1 and spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp
    rows = -(-shape[0] // fsdp)
    rest = 1
    for size in shape[1:]:
        rest *= size
    return rows * rest


def full_numel(spec: ParamSpec, tp: int) -> int:
    """Elements of the TP-local tensor (what an FSDP all-gather materialises)."""
    return shard_numel(spec, tp, 1)


@dataclass(frozen=True)
class RankParts:
    """What one pipeline rank holds: blocks, and whether the embedding / the head are on it."""

    layers: int
    embedding: bool
    head: bool
    stage_layers: tuple[int, ...]
    moe_layers: int = 0
    """Of ``layers``, the MoE blocks (ids >= first_k_dense)."""


def rank_parts(args: ModelArgs, layout: Layout, rank: int) -> RankParts:
    counts = stage_layer_counts(args.n_layers, layout) if layout.pp > 1 else [args.n_layers]
    stages = stages_of_rank(layout, rank) if layout.pp > 1 else [0]
    last = len(counts) - 1
    moe = 0
    if args.is_moe:
        starts = [sum(counts[:s]) for s in stages]
        moe = sum(max(0, a + counts[s] - max(a, args.first_k_dense)) for a, s in zip(starts, stages, strict=True))
    layers = sum(counts[s] for s in stages)
    return RankParts(layers, 0 in stages, last in stages, tuple(counts[s] for s in stages), moe)


def local_param_numel(args: ModelArgs, layout: Layout, parts: RankParts) -> int:
    """Parameter elements rank 0 of the FSDP x TP grid holds for these parts (the optimizer's share)."""
    tp, fsdp = layout.tp, layout.fsdp_size
    total = blocks_numel(args, layout, parts, fsdp)
    if parts.embedding:
        total += part_numel(args, "embedding", tp, fsdp)
    if parts.head:
        total += part_numel(args, "head", tp, fsdp)
    return total


def routed_rank_numel(args: ModelArgs, layout: Layout, rank: int) -> int:
    """Of a pipeline rank's parameter elements (rank 0 of its FSDP x TP grid), those of the routed experts."""
    return rank_parts(args, layout, rank).moe_layers * routed_numel(args, layout.fsdp_size, layout.ep)


def gathered_layer_bytes(args: ModelArgs, layout: Layout) -> float:
    """Bytes of one block's all-gathered (TP-local) weights in the compute dtype (Float8 all-gather: 1 byte)."""
    e = DTYPE_BYTES[layout.param_dtype]
    if args.is_moe:  # the larger block kind; the routed experts (E / ep of them) are gathered in the compute dtype
        tp, ep = layout.tp, layout.ep
        linear = sum(full_numel(p, tp) for p in moe_block_params(args) if p.tp_dim is not None)
        fp8 = linear if layout.float8 and layout.float8_all_gather else 0
        moe = moe_block_full_numel(args, tp, ep) * e - fp8 * (e - 1)
        return max(moe, gathered_layer_bytes(dense_view(args), layout))
    linear = linear_numel(args, layout.tp)
    fp8 = layout.float8 and layout.float8_all_gather
    return linear * (1 if fp8 else e) + (part_numel(args, "block", layout.tp, 1) - linear) * e


@functools.lru_cache(maxsize=1024)
def linear_numel(args: ModelArgs, tp: int) -> int:
    """Elements of one block's TP-local linear weights (the matmul parameters)."""
    return sum(full_numel(p, tp) for p in block_params(args) if p.tp_dim is not None)
