"""Tensor parallel (Megatron-style) with DTensor ``parallelize_module``, sequence parallel and loss parallel.

Plans are literal dicts, one for the model's root modules and one per transformer block:

* attention: ``wq``/``wk``/``wv`` column-wise (each rank owns ``n_heads / tp`` heads; q/k/v biases split with them),
  ``wo`` row-wise; per-head q/k norms (Qwen3) replicated, acting on the local heads;
* feed-forward: ``w1``/``w3`` column-wise, ``w2`` row-wise;
* sequence parallel (on by default): the residual stream and the norms are split along the sequence (``Shard(1)``);
  the inputs of attention and feed-forward are all-gathered, their row-wise outputs reduce-scattered;
* lean saves (``model.lean_saves``, on by default): under sequence parallel, wq/wk/wv and w1/w3 save the sequence
  shard of their input and all-gather it again in backward (parallel/sequence_shard_saves.py);
* loss parallel (on unless ``parallelism.disable_loss_parallel``): the output projection leaves the logits
  vocab-sharded (``Shard(-1)``) and the cross-entropy runs inside model/loss.py's ``loss_parallel_context``;
* Float8 (tensorwise) blocks use torchao's Float8 styles, so the all-gathers of activations move Float8 bytes;
* async TP lets inductor overlap the TP collectives with the matmuls (CUDA symmetric memory, needs compile).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.errors import ConfigError
from meshforge.model.moe import MoE
from meshforge.parallel.float8 import torchao
from meshforge.parallel.sequence_shard_saves import GatheredProjections
from meshforge.parallel.vocab_embedding import vocab_parallel


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool,
    async_tp: bool,
) -> None:
    """Shard ``model``'s linear layers (and, under sequence parallel, its norms' activations) over ``tp_mesh``.

    ``float8``: the model's linear layers were converted to torchao Float8Linear with tensorwise scaling; blocks
    whose linear layers all are Float8 use the Float8-aware styles. Modules that are ``None`` (pipeline stages) are
    skipped.
    """
    if async_tp and tp_mesh.device_type != "cuda":
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel = true needs CUDA symmetric memory, but the device is "
            f"{tp_mesh.device_type}; set it to false"
        )
    plan = root_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    present = {key: style for key, style in plan.items() if getattr(model, key, None) is not None}
    if present:
        parallelize_module(model, tp_mesh, present)
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for block in layers.values():
        use_float8 = float8 and _all_linears_float8(block)
        plan = block_plan(sequence_parallel=sequence_parallel, float8=use_float8)
        if isinstance(getattr(block, "feed_forward", None), MoE):
            plan = moe_block_plan(plan, block.feed_forward, sequence_parallel=sequence_parallel)  # type: ignore[arg-type]
        if getattr(block.attention, "q_norm", None) is not None:
            plan.update(head_norm_plan())
        if sequence_parallel and getattr(getattr(model, "args", None), "lean_saves", True):
            save_sequence_shards(block, plan, tp_mesh)
        parallelize_module(block, tp_mesh, plan)
    if async_tp:
        enable_async_tp(tp_mesh)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor's micro-pipeline pass rewrite all-gather + matmul and matmul + reduce-scatter of the compiled
    blocks into overlapped symmetric-memory kernels (``symm_mem.fused_all_gather_matmul`` /
    ``fused_matmul_reduce_scatter``). The pass skips every group without symmetric memory, and in torch 2.13 only
    ``enable_symm_mem_for_group`` registers a group (deprecated, yet still the only writer: TorchTitan calls it too).
    The patterns exist only under sequence parallel, and the kernels only with NCCL (parallel/dims.py checks both)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    torch._inductor.config._micro_pipeline_tp = True  # type: ignore[attr-defined]


def root_plan(*, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Embedding (vocab rows split), final norm, output projection (vocab columns split)."""
    logits = Shard(-1) if loss_parallel else Replicate()
    if not sequence_parallel:
        return {
            "tok_embeddings": EmbeddingParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "norm": ReplicateParallel(),
            "output": ColwiseParallel(
                input_layouts=Replicate(), output_layouts=logits, use_local_output=not loss_parallel
            ),
        }
    return {
        "tok_embeddings": EmbeddingParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=logits, use_local_output=not loss_parallel),
    }


def block_plan(*, sequence_parallel: bool, float8: bool) -> dict[str, ParallelStyle]:
    """One transformer block: heads and FFN columns split; under sequence parallel the norms and residual too."""
    colwise, rowwise, prepare_input = _styles(float8)
    if not sequence_parallel:
        return {
            "attention_norm": ReplicateParallel(),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(),
            "ffn_norm": ReplicateParallel(),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(),
            "feed_forward.w3": colwise(),
        }
    return {
        "attention_norm": SequenceParallel(),
        # (hidden, rope): gather the sequence-sharded hidden state, leave the RoPE table alone
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }


def save_sequence_shards(block: nn.Module, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> None:
    """Under sequence parallel, let attention and the dense feed-forward apply their column-parallel projections to
    the sequence shard, saving it instead of the gathered input (parallel/sequence_shard_saves.py): their input
    gathers leave the plan. Only for plain ``nn.Linear`` projections without bias (Float8 linears and Qwen2's q/k/v
    biases keep the DTensor styles)."""
    for name, linears in (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3"))):
        module = getattr(block, name)
        layers = [getattr(module, n, None) for n in linears]
        if all(type(layer) is nn.Linear and layer.bias is None for layer in layers) and name in plan:
            del plan[name]
            module.project = GatheredProjections(tp_mesh)


def moe_block_plan(plan: dict[str, ParallelStyle], moe: MoE, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A block plan with an MoE feed-forward: every tensor-parallel rank routes the whole (gathered) sequence, the
    router is replicated, the shared experts are split like a dense FFN, the routed experts are left to expert
    parallel (on the ep axis, not tp)."""
    plan = {key: style for key, style in plan.items() if not key.startswith("feed_forward")}
    plan["feed_forward.router.gate"] = ReplicateParallel()
    if moe.shared_experts is not None:
        plan.update(
            {
                "feed_forward.shared_experts.w1": ColwiseParallel(),
                "feed_forward.shared_experts.w2": RowwiseParallel(),
                "feed_forward.shared_experts.w3": ColwiseParallel(),
            }
        )
    if sequence_parallel:  # gather the sequence for routing; hand back this rank's slice (no communication)
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_input=True,
        )
    return plan


def head_norm_plan() -> dict[str, ParallelStyle]:
    """Qwen3's per-head q/k RMSNorms: each rank normalises its own heads over head_dim (no communication); the
    weights stay replicated. The input (batch, seq, local heads, head_dim) is marked ``Shard(2)`` (a plain tensor in,
    a plain tensor out), so the weights' gradients are summed over the ranks' heads as the norms' under sequence
    parallel are summed over the sequence."""
    return {
        f"attention.{name}": SequenceParallel(sequence_dim=2, use_local_output=True) for name in ("q_norm", "k_norm")
    }


class EmbeddingParallel(RowwiseParallel):
    """RowwiseParallel (vocab rows split, looked up on the shard) whose output collective completes before the output
    is handed on.

    The stock style returns an AsyncCollectiveTensor; fed into a torch.compile'd block, its gradient reaches the
    redistribution as a plain tensor ("'Tensor' object has no attribute '_local_tensor'", torch 2.13, TP + compile).
    Nothing could overlap with this collective anyway: the first block needs its result at once.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """RowwiseParallel's, then the lookup on the vocabulary shard (parallel/vocab_embedding.py: the weight's
        gradient the shard's size, not the full vocabulary's on every rank)."""
        module = super()._apply(module, device_mesh)
        vocab_parallel(module)
        return module

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> torch.Tensor:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


class ReplicateParallel(ParallelStyle):
    """Norms without sequence parallel: parameters become replicated DTensors (every parameter of the model is then
    a DTensor on the TP mesh, as the global gradient norm needs), inputs and outputs stay plain replicated tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for p_name, param in list(mod.named_parameters(recurse=False)):
                replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
                mod.register_parameter(p_name, nn.Parameter(replicated))

        def to_dtensor(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(mod: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return outputs.to_local()

        return distribute_module(module, device_mesh, replicate_params, to_dtensor, to_local)  # type: ignore[arg-type]


def _styles(float8: bool) -> tuple[Any, Any, Any]:
    """(column-wise, row-wise, prepare-input) style classes, Float8-aware when ``float8``."""
    if float8:
        tp = torchao("torchao.float8.float8_tensor_parallel")
        return tp.Float8ColwiseParallel, tp.Float8RowwiseParallel, tp.PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def _all_linears_float8(block: nn.Module) -> bool:
    float8_linear = torchao("torchao.float8.float8_linear").Float8Linear
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(isinstance(m, float8_linear) for m in linears)
