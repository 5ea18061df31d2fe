"""Activation checkpointing: none, full (recompute each block) or selective (every N-th block, or per op: save the
outputs of attention and of every other matmul, recompute the rest — TorchTitan's policy, which the planner's memory
model and the article's 8B figures assume; saving every matmul would cost ~20 GiB more on the 8B layout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshforge.config.schema import ActivationCheckpoint

# ops whose outputs selective-op AC keeps (everything else in a block is recomputed in backward)
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


# Profiler markers are no computation, but per-op SAC counts them like ops and requires the recompute to replay the
# forward's exact sequence. FSDP's hooks on a module nested in a block (the routed experts under EP) emit a different
# sequence in the recompute: the first FSDP module to run there takes the root pre-forward ("FSDP::root_pre_forward")
# because the root's forward state was reset after the forward. Left counted, EP x TP crashed in backward with
# "profiler._record_function_enter_new.default invocation index 3 ... not found in storage" (issue 28).
PROFILER_OPS = (
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def ignore_profiler_ops_in_sac() -> None:
    """Let per-op selective AC pass profiler markers through uncounted (idempotent; torch's own ignore set)."""
    torch_checkpoint.SAC_IGNORED_OPS.update(PROFILER_OPS)


def _op_contexts() -> tuple[object, object]:
    """Fresh contexts per checkpointed call: matmuls are counted separately in forward and in recomputation so both
    passes make the same save/recompute decision for the same matmul."""
    mm_counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_counts[mode] += 1
            if mm_counts[mode] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrap_block(block: nn.Module, cfg: ActivationCheckpoint, index: int) -> nn.Module:
    """The block, wrapped for recomputation according to the mode (unchanged when it is not checkpointed)."""
    if cfg.mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.mode == "selective" and cfg.selective_ac_option == "op":
        ignore_profiler_ops_in_sac()
        context_fn: Callable[[], tuple[object, object]] = _op_contexts
        return checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
    if cfg.mode == "selective" and index % int(cfg.selective_ac_option) == 0:
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return block


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap the transformer blocks of ``model`` in place."""
    if cfg.mode == "none":
        return
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for i, (name, block) in enumerate(list(layers.items())):
        layers[name] = wrap_block(block, cfg, i)
