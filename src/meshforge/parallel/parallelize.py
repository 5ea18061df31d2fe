"""parallelize(): apply the strategies to one model (or pipeline stage) in the ONE documented order:

    Float8 conversion -> tensor/sequence parallel -> expert parallel -> context parallel -> activation checkpointing
    -> torch.compile -> FSDP/HSDP

TP must see the final linear modules (Float8-aware plans if converted); CP replaces each block's attention core
(``attention.sdpa``) before AC wraps the blocks; compile wraps the checkpointed blocks so recomputation is compiled
too; FSDP goes last so it shards the final parameters (DTensors on the (dp, tp) mesh under 2-D), over ``dp_shard_cp``
(context-parallel ranks hold different tokens, so their gradients are averaged like data-parallel ones).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.config.schema import ActivationCheckpoint, Compile, Float8, JobConfig, Parallelism, Training
from meshforge.errors import ConfigError
from meshforge.model.moe import moe_layers
from meshforge.parallel.activation_ckpt import apply_ac
from meshforge.parallel.context_parallel import apply_cp, resolve_cp_impl
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.parallel.expert_parallel import apply_ep
from meshforge.parallel.float8 import apply_float8
from meshforge.parallel.fsdp import apply_fsdp
from meshforge.parallel.layout import resolve_reshard_after_forward
from meshforge.parallel.tensor_parallel import apply_tp


def check_compile_backend(backend: str) -> None:
    """A one-line ValueError for a torch.compile backend this torch does not know."""
    from torch._dynamo.backends.registry import list_backends, lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(backend)
    except InvalidBackend:
        raise ConfigError(
            f"compile.backend = {backend!r} is not a torch.compile backend here; choose one of "
            f"{', '.join(list_backends())}"
        ) from None


def apply_compile(model: nn.Module, cfg: Compile, *, tp: bool = False) -> None:
    """torch.compile each transformer block (identical blocks share one compiled graph). ``tp``: under tensor
    parallel a fully recomputed dense block (full / every-N AC) is compiled *inside* its checkpoint (the checkpoint
    runs eagerly and replays the compiled forward): compiled around it, AOT autograd's partitioner saves the block's
    DeviceMesh (a graph input of the DTensor ops) among the recomputed region's tensors and the forward fails with
    "expected all tensors_saved_with_vc_check to be Tensors" (torch 2.13, aot_eager and inductor, any device)."""
    check_compile_backend(cfg.backend)
    if tp:
        compile_inside_checkpoints(model, cfg)
    if moe_layers(model):
        # an MoE layer counts its routed tokens in place (a buffer the balancer reads); inside a checkpointed block
        # dynamo refuses that side effect unless told the recompute must not replay it, which is the intent
        # (eager AC skips it by the graph-task check in model/moe.py)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for name, block in list(layers.items()):
        if not getattr(block, "_compiled_inside", False):
            layers[name] = torch.compile(block, backend=cfg.backend, fullgraph=True)  # type: ignore[assignment]


def compile_inside_checkpoints(model: nn.Module, cfg: Compile) -> None:
    """Compile the wrapped module of every fully recomputed dense block, leaving its checkpoint eager. Not for
    per-op selective AC (its policy must see the ops: that order works) nor for MoE blocks (the replayed compiled
    forward would count routed tokens a second time; composability refuses that combination)."""
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for block in layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        per_op = "context_fn" in getattr(getattr(block, "checkpoint_fn", None), "keywords", {})
        if inner is None or per_op or moe_layers(inner):
            continue
        setattr(block, "_checkpoint_wrapped_module", torch.compile(inner, backend=cfg.backend, fullgraph=True))  # noqa: B010
        setattr(block, "_compiled_inside", True)  # noqa: B010


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    *,
    parallelism: Parallelism,
    training: Training,
    ac: ActivationCheckpoint,
    compile_cfg: Compile,
    float8: Float8,
    expert_mesh: DeviceMesh | None = None,
    accumulate_dtype: str = "float32",
) -> None:
    """Apply every enabled strategy to ``model`` in place (parameters stay on the meta device). ``expert_mesh``: the
    (efsdp, ep) mesh of ParallelDims.build_expert_mesh under expert parallel. ``accumulate_dtype``:
    gradient_sync.accumulate_dtype (parallel/fsdp.py ``accumulate_in``)."""
    if float8.enable:
        apply_float8(model, float8, fsdp=dims.fsdp_enabled)
    tp_mesh = sub_mesh(mesh, "tp")
    if tp_mesh is not None:
        apply_tp(
            model,
            tp_mesh,
            sequence_parallel=parallelism.enable_sequence_parallel,
            loss_parallel=not parallelism.disable_loss_parallel,
            # Float8 styles all-gather Float8 activations: NCCL only (gloo has no float8 dtypes)
            float8=float8.enable and float8.recipe_name == "tensorwise" and tp_mesh.device_type == "cuda",
            async_tp=parallelism.enable_async_tensor_parallel,
        )
    if expert_mesh is not None:
        apply_ep(model, expert_mesh["ep"])
    cp_mesh = sub_mesh(mesh, "cp")
    if cp_mesh is not None:
        apply_cp(model, cp_mesh, impl=resolve_cp_impl(parallelism.context_parallel_impl, cp_mesh.device_type))
    apply_ac(model, ac)
    if compile_cfg.enable:
        apply_compile(model, compile_cfg, tp=tp_mesh is not None)
    if dims.fsdp_enabled:
        fsdp_mesh = sub_mesh(mesh, "dp_replicate", "dp_shard_cp")
        assert fsdp_mesh is not None
        apply_fsdp(
            model,
            fsdp_mesh,
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            reshard_after_forward=resolve_reshard_after_forward(parallelism.fsdp_reshard_after_forward, dims.pp > 1),
            expert_mesh=expert_mesh,
            cpu_offload=training.enable_cpu_offload,
            accumulate_dtype=accumulate_dtype,
        )


def parallelize_job(
    model: nn.Module,
    cfg: JobConfig,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    parallelism: Parallelism | None = None,
) -> None:
    """``parallelize`` with a job's sections: the one mapping training and the dry run / exact memory step share
    (``parallelism``: the section as applied, tools/dry_run.py's meta form; the job's own by default)."""
    parallelize(
        model,
        dims,
        mesh,
        parallelism=parallelism or cfg.parallelism,
        training=cfg.training,
        ac=cfg.activation_checkpoint,
        compile_cfg=cfg.compile,
        float8=cfg.quantize.dense.float8,
        expert_mesh=dims.build_expert_mesh(mesh),
        accumulate_dtype=cfg.gradient_sync.accumulate_dtype,
    )
