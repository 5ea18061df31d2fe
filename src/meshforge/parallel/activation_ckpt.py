"""Activation checkpointing: none, full (recompute each block) or selective (every N-th block, or per op: save the
outputs of matmuls and attention, recompute the cheap element-wise ops)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshforge.config import ActivationCheckpoint

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


def _op_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_contexts() -> tuple[object, object]:
    return create_selective_checkpoint_contexts(_op_policy)


def wrap_block(block: nn.Module, cfg: ActivationCheckpoint, index: int) -> nn.Module:
    """The block, wrapped for recomputation according to the mode (unchanged when it is not checkpointed)."""
    if cfg.mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.mode == "selective" and cfg.selective_ac_option == "op":
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
