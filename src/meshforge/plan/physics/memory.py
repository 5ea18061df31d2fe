"""Memory per device, the bytes side: sharded parameter/gradient/optimizer state bytes, activation bytes per token
per AC mode, the loss's bytes per logit, and the optimizer's traffic per parameter. Pure Python. What a rank holds
(its parameter counts) is plan/physics/parts.py; which terms are live at the step's peak, with the communication
buffers, is plan/physics/peak.py.
"""

from __future__ import annotations

from meshforge.model.flavors import ModelArgs
from meshforge.plan.layout import Layout
from meshforge.plan.physics.parts import DTYPE_BYTES, MAX_LOAD

STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}
"""fp32 master weights, fp32 sharded gradients, AdamW exp_avg + exp_avg_sq (FSDP2 keeps the model in fp32)."""
LOSS_BYTES_PER_LOGIT = 12
"""Cross-entropy on .float() logits (fused log-softmax): fp32 output saved (4) + its gradient (4) + the input's (4)."""
LOSS_PARALLEL_BYTES_PER_LOGIT = 16
"""Vocab-parallel cross-entropy (torch loss_parallel, decomposed into DTensor ops): five live fp32 temporaries at the
backward's peak (saved output, incoming gradient, exp(output), its product with the sum, the result)."""
COMPILED_LOSS_BYTES_PER_LOGIT = 4
"""torch.compile'd cross-entropy on .float() logits (one fused kernel each way): the bf16 logits it saves and their
bf16 gradient; the fp32 copies are never materialised (an assumption from inductor's fusion, not traced: the exact
step runs eager)."""
NORM_EAGER_BYTES = 8
"""Eager RMSNorm saves two fp32 copies of its input (x.float() twice) per hidden element."""
OPTIMIZER_TRAFFIC_PER_PARAM = 48
"""Bytes moved per local parameter per step: AdamW (foreach, fp32: read p, g, m, v, write p, m, v, temporaries),
gradient-norm clipping and zero_grad."""


def routed_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """Saved bytes per token, averaged over the blocks, of the routed rows of MoE blocks without checkpointing: per
    row (top_k per token) the experts' input and the fp32 expert output of the gate-weighted sum, at MAX_LOAD under
    EP. TP ranks each route the whole sequence. Checkpointed blocks (full, or per-op: the grouped matmuls and the
    all-to-alls are not on the save list, parallel/activation_ckpt.py) recompute them."""
    if not args.is_moe:
        return 0.0
    per_row = (DTYPE_BYTES[layout.param_dtype] + 4) * args.dim
    load = MAX_LOAD if layout.ep > 1 else 1.0
    plain = block_modes(args, layout).get("none", 0.0)
    share = (args.n_layers - args.first_k_dense) / args.n_layers
    return load * args.top_k * per_row * plain * share


def activation_bytes_per_token(args: ModelArgs, layout: Layout, mode: str) -> float:
    """Bytes one block keeps per token of the microbatch until its backward (mode: none/full/op), on one TP rank.

    Under tensor parallel with sequence parallel, everything is sharded by TP except the all-gathered inputs of the
    column-parallel matmuls and the pre-reduce-scatter outputs of the row-parallel ones, which are full-length.
    """
    e, tp = DTYPE_BYTES[layout.param_dtype], layout.tp
    d, q, kv, f, heads = (
        args.dim,
        args.n_heads * args.head_dim,
        args.kv_heads * args.head_dim,
        args.ffn_hidden_dim,
        args.n_heads,
    )
    kv_sdpa = q if kv < q else kv  # meshforge repeats K/V to all heads before SDPA
    gathered = 2 * e * d if tp > 1 else 0.0  # AG'd norm outputs (attention, FFN) kept for the matmuls' backward
    if mode == "full":
        return e * d / tp
    if mode == "op":
        # every other matmul (wq, wv, w1, w2) + SDPA output and logsumexp: meshforge's policy is TorchTitan's
        sharded = e * (q + kv + f) + e * q + 4 * heads
        rowwise = 1
        sharded += e * d  # the checkpointed block input
        if tp > 1:  # w2's output is full-length before its reduce-scatter; both reduce-scatters' outputs are saved
            return sharded / tp + rowwise * e * d * (1 + 2 / tp)
        return sharded + rowwise * e * d
    if layout.lean_saves and autocast(layout):
        return autocast_bytes_per_token(args, layout)
    if layout.lean_saves:
        return lean_bytes_per_token(args, layout)
    if layout.compile:
        sharded = 4 * e * d + e * (q + 2 * kv_sdpa) + 2 * e * q + 4 * heads + 2 * e * f
    else:
        sharded = 2 * (NORM_EAGER_BYTES + e) * d + e * (q + 2 * kv_sdpa) + 2 * e * q + 4 * heads + 4 * e * f
    return sharded / tp + gathered


def lean_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """What one block without checkpointing saves per token on one TP rank under model.lean_saves, as the exact step
    saves it op by op (``train --dry-run --by-op``, docs/benchmarks/memory-at-scale.md): each RMSNorm its input and
    the next matmuls' input (the sequence shard under SP), SDPA's q, K, V, output and fp32 logsumexp (GQA's K/V as
    they are: the kernel's enable_gqa, no copy per query head), SwiGLU's two matmul outputs and w2's input, and under
    mixed precision RoPE's cos/sin cast to the compute dtype at every block (FSDP's input cast; not sharded by TP).
    Context parallel's all-gather core saves the whole sequence's K/V (cp x the local), the ring the local chunk.
    compile: the same saves (the custom autograd functions fix them; inductor may recompute pointwise ops further:
    an upper bound, not traced)."""
    e, tp = DTYPE_BYTES[layout.param_dtype], layout.tp
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    kv_saved = kv * (layout.cp if layout.cp > 1 and layout.cp_impl != "ring" else 1)
    sharded = 4 * e * args.dim + 2 * e * q + 2 * e * kv_saved + 4 * args.n_heads + 3 * e * args.ffn_hidden_dim
    rope = e * args.head_dim if layout.param_dtype != "float32" else 0.0
    return sharded / tp + rope


def autocast(layout: Layout) -> bool:
    """Without FSDP nobody casts the parameters: a bf16 / fp16 run computes under autocast (device/precision.py)."""
    return not layout.degrees.fsdp_enabled and layout.param_dtype != "float32"


def autocast_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """lean_bytes_per_token under autocast (``--by-op`` on Llama 3.2 1B, one rank: 869.1 MiB per block at 8192
    tokens, this plus autocast_weight_bytes to the 0.1 MiB): the residual stream stays fp32, so both norms save fp32
    inputs, and autocast casts the normed input once per matmul (wq, wk, wv, w1, w3: five copies in the compute
    dtype); RoPE's table is not cast. TP without FSDP is taken as sharding these alike (not traced)."""
    e = DTYPE_BYTES[layout.param_dtype]
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    kv_saved = kv * (layout.cp if layout.cp > 1 and layout.cp_impl != "ring" else 1)
    attention = 2 * e * q + 2 * e * kv_saved + 4 * args.n_heads
    return (2 * 4 * args.dim + 5 * e * args.dim + attention + 3 * e * args.ffn_hidden_dim) / layout.tp


def block_modes(args: ModelArgs, layout: Layout) -> dict[str, float]:
    """Fraction of blocks under each checkpoint mode: none / full / op (selective N = every N-th block full)."""
    if layout.ac_mode == "full":
        return {"full": 1.0}
    if layout.ac_mode == "none":
        return {"none": 1.0}
    if layout.sac_option == "op":
        return {"op": 1.0}
    every = int(layout.sac_option)
    full = -(-args.n_layers // every) / args.n_layers
    return {"full": full, "none": 1.0 - full}


def saved_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """Average bytes per block per token kept until backward, over the AC modes of the blocks."""
    return sum(
        share * activation_bytes_per_token(args, layout, mode) for mode, share in block_modes(args, layout).items()
    )


def offload_kept_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """Average bytes per block per token that activation offload leaves on the device: per-op SAC's kept op outputs.

    torch.utils.checkpoint (non-reentrant) packs what runs inside a checkpointed block with its own saved-tensor hooks,
    which take precedence over the outer ``save_on_cpu``; SAC's cache of the kept op outputs is the checkpoint's, so it
    stays where it was made. What moves is what the outer hooks see: each checkpointed block's input (full AC, and the
    input of a SAC block) and everything a block without AC saves. Measured: 8B FSDP 8, seq 8192, lb 2, per-op SAC:
    27.06 GiB of activations stay on the device in the exact run, the kept outputs' 27.06 GiB here."""
    e, tp = DTYPE_BYTES[layout.param_dtype], layout.tp
    share = block_modes(args, layout).get("op", 0.0)
    return share * (activation_bytes_per_token(args, layout, "op") - e * args.dim / tp)


def transient_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """Working set of one block's backward per token: its recomputed activations plus activation gradients (at the
    SwiGLU's backward: the gradients of its product, of w3's and w1's outputs and of silu's input, and of the two
    matmuls' input and the residual)."""
    e, tp = DTYPE_BYTES[layout.param_dtype], layout.tp
    grads = e * (2 * args.dim + 4 * args.ffn_hidden_dim) / tp
    recompute = 0.0 if layout.ac_mode == "none" else activation_bytes_per_token(args, layout, "none")
    if layout.cp > 1:  # the gathered K/V of the whole sequence
        recompute += 2 * e * args.n_heads * args.head_dim / tp * layout.cp
    return recompute + grads
