"""Mixture-of-experts feed-forward (DeepSeek-V3 / Qwen3-MoE style): a router, routed SwiGLU experts, shared experts.

* Router: ``Linear(dim, experts)``; scores in float32 (softmax over experts or per-expert sigmoid); the expert bias
  (auxiliary-loss-free balancing) shifts which experts are *chosen*, never the gate values; optional node-limited
  routing (keep the best ``n_limited_groups`` of ``n_expert_groups`` groups, by the sum of each group's top-2 scores);
  optional renormalisation of the top-k scores and a scale.
* Routed experts: SwiGLU weights stored as 3-D tensors (experts, ...), computed with ``torch._grouped_mm`` where it
  runs (see :func:`grouped_mm_supported`) and a loop over experts elsewhere, with the same results.
* Token dispatch is a replaceable step (``MoE.dispatch``): the local experts by default, an all-to-all under expert
  parallel (meshforge.parallel.expert_parallel), so the model knows nothing about process groups.
* Load statistics: ``tokens_per_expert`` counts the routed tokens since the last balancing step (all micro-steps);
  meshforge.train.moe_balance turns them into the bias update and the max/mean load metric.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.model.flavors import ModelArgs
from meshforge.model.lean import silu_mul


class Router(nn.Module):
    """Token-choice top-k router with fp32 scores, expert bias, group limit, normalisation and scale."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.top_k
        self.score_func, self.route_norm, self.route_scale = args.score_func, args.route_norm, args.route_scale
        self.n_groups, self.n_limited_groups = args.n_expert_groups, args.n_limited_groups
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> gate values (tokens, top_k) fp32, expert ids (tokens, top_k), scores (tokens, experts)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        if self.n_groups > 1:
            choice = self._limit_groups(choice)
        indices = choice.topk(self.top_k, dim=-1, sorted=True).indices  # (tokens, top_k)
        top = scores.gather(1, indices)
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * self.route_scale, indices, scores

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) the experts outside each token's n_limited_groups best groups."""
        grouped = choice.unflatten(-1, (self.n_groups, -1))  # (tokens, groups, experts per group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, groups)
        keep = group_scores.topk(self.n_limited_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(-2)


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands: CUDA sm80+ in bf16 (A100s too); CPU (torch 2.13) in
    fp32 or bf16 when every contracting dim is 16-byte aligned; never for fp32 under torch.compile (the meta
    kernel wants bf16)."""
    if not hasattr(torch, "_grouped_mm") or any(w.dtype != x.dtype for w in weights):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.dtype == torch.float32 and torch.compiler.is_compiling():
        return False
    align = 16 // x.element_size()
    return all(w.shape[-1] % align == 0 for w in weights)


def gate(a: torch.Tensor, b: torch.Tensor, lean: bool = True) -> torch.Tensor:
    """silu(a) * b; ``lean``: saving a and b only, silu recomputed in backward (model/lean.py, bit-identical)."""
    return silu_mul(a, b) if lean else F.silu(a) * b


def swiglu_grouped_mm(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor, lean: bool = True
) -> torch.Tensor:
    """Experts' SwiGLU on tokens grouped by expert: x (tokens, dim), w1/w3 (experts, hidden, dim), w2 (experts, dim,
    hidden), counts (experts,) -> (tokens, dim). One grouped GEMM per projection, no host sync."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    a, b = (torch._grouped_mm(x, w.transpose(-2, -1), offs) for w in (w1, w3))
    return torch._grouped_mm(gate(a, b, lean), w2.transpose(-2, -1), offs)


def swiglu_loop(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor, lean: bool = True
) -> torch.Tensor:
    """The same as :func:`swiglu_grouped_mm` with one matmul per expert (a host sync for the group sizes)."""
    outs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
        outs.append(gate(chunk @ w1[e].T, chunk @ w3[e].T, lean) @ w2[e].T)
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])


class GroupedExperts(nn.Module):
    """Routed experts as 3-D weights: w1, w3 (experts, hidden, dim), w2 (experts, dim, hidden).

    Under expert parallel the weights are DTensors sharded on dim 0 over the ``ep`` axis; forward uses the local
    experts, so ``counts`` has one entry per local expert.
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, lean: bool = True) -> None:
        super().__init__()
        self.lean = lean
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.use_grouped_mm = True
        # expert parallel: a weight's gradient sums the tokens of all ep peers while data parallel averages, so it
        # is scaled by 1 / ep here (exact, and FSDP's own averaging over the remaining ranks stays untouched)
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (tokens, dim) grouped by expert in order, counts (local experts,) -> (tokens, dim)."""
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm has no autocast rule: cast as autocast would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = x.to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype)
        if self.use_grouped_mm and grouped_mm_supported(x, w1, w3) and grouped_mm_supported(x.new_empty(0, 1), w2):
            return swiglu_grouped_mm(x, w1, w2, w3, counts, self.lean)
        return swiglu_loop(x, w1, w2, w3, counts, self.lean)


class ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _local(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


Dispatch = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_counts(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Routed token copies per expert, (n_experts,) int64, computed on the device without a host read (unlike
    ``torch.bincount``, whose output size depends on the data, so it syncs and dynamo cannot trace it)."""
    flat = indices.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add(0, flat, torch.ones_like(flat))


def _in_backward() -> bool:
    """Whether this forward is an activation-checkpoint recompute inside backward (its tokens were counted once).
    Under torch.compile the recompute is part of the compiled backward graph, which replays no buffer update, and
    the graph-task query is untraceable (dynamo: "Unsupported torch.* op returned non-Tensor"), so: never."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._current_graph_task_id() != -1)


class MoE(nn.Module):
    """x (batch, seq, dim) -> (batch, seq, dim): shared experts + gate-weighted sum of the top-k routed experts."""

    def __init__(self, args: ModelArgs, shared_experts: nn.Module | None) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.top_k
        self.aux_loss_coeff = args.aux_loss_coeff
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.n_routed_experts, args.lean_saves)
        self.shared_experts = shared_experts  # a dense SwiGLU of width n_shared_experts x moe_ffn_dim, or None
        self.expert_bias: torch.Tensor | None
        if args.load_balance_coeff > 0:
            self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts), persistent=True)
        else:
            self.expert_bias = None
        self.tokens_per_expert: torch.Tensor
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts), persistent=False)
        # (tokens grouped by expert, counts per expert) -> expert outputs; None: the local experts (no parallelism)
        self.dispatch: Dispatch | None = None
        self.count_loads = True  # off while a pipeline stage infers shapes on placeholder tensors

    def init_buffers(self) -> None:
        """Zero the bias and the load counters (after ``to_empty``)."""
        self.tokens_per_expert.zero_()
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # (tokens, dim)
        top, indices, scores = self.router(tokens, self.expert_bias)
        counts = expert_counts(indices, self.n_experts)  # (experts,)
        if self.count_loads and not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        order = torch.argsort(indices.flatten(), stable=True)  # token copies grouped by expert
        dispatch = self.experts if self.dispatch is None else self.dispatch
        routed = dispatch(tokens[order // self.top_k], counts)  # (tokens x top_k, dim)
        routed = routed[torch.argsort(order)].view(-1, self.top_k, dim)  # back to (tokens, top_k, dim)
        out = (routed.float() * top.unsqueeze(-1)).sum(dim=1).type_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.aux_loss_coeff > 0 and self.training:
            out = AddAuxLoss.apply(out, self.aux_loss(scores.view(batch, seq, -1), indices.view(batch, seq, -1)))
        return out.view(batch, seq, dim)

    def aux_loss(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sequence-wise balance loss alpha x sum_i f_i P_i, averaged over sequences (DeepSeek-V3 eqs. 17-20):
        scores (batch, seq, experts), indices (batch, seq, top_k)."""
        seq = scores.shape[1]
        probs = scores / scores.sum(dim=-1, keepdim=True)
        p = probs.mean(dim=1)  # (batch, experts)
        hits = torch.zeros_like(p).scatter_add_(
            1, indices.flatten(1), torch.ones_like(indices.flatten(1), dtype=p.dtype)
        )
        f = hits * self.n_experts / (self.top_k * seq)
        return self.aux_loss_coeff * (f * p).sum(dim=-1).mean()


class AddAuxLoss(torch.autograd.Function):
    """Identity on the hidden state that adds d(aux)/d(params) to backward (the loss itself is not logged), so the
    auxiliary loss works inside pipeline stages too. The gradient weight is 1 per micro-step, as in DeepSeek's code."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of a model (or of a pipeline stage)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def load_counting_paused(model: nn.Module) -> Iterator[None]:
    """Forward passes inside do not count routed tokens (e.g. a pipeline stage's shape inference)."""
    layers = moe_layers(model)
    for layer in layers:
        layer.count_loads = False
    try:
        yield
    finally:
        for layer in layers:
            layer.count_loads = True
