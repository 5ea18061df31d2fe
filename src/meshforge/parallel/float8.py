"""Float8 training of the linear layers via torchao (``quantize.dense.float8``).

``convert_to_float8_training`` swaps ``nn.Linear`` for torchao's ``Float8Linear``: inputs, weights and output
gradients are cast to Float8 with dynamic scales (one per tensor: ``tensorwise``; one per row: ``rowwise``) and the
matmuls run in ``torch._scaled_mm``. On CUDA this needs compute capability >= 8.9 (Ada, Hopper, Blackwell); on CPU
``_scaled_mm`` runs (slowly), which is what the tests use. Layers whose name contains one of ``filter_fqns``
(default: the output projection) or whose dimensions are not multiples of 16 stay in high precision.

With tensorwise scaling under FSDP, ``enable_fsdp_float8_all_gather`` all-gathers the weights in Float8 (half the
bytes of bf16). Each weight's scale needs the amax of the whole (sharded) weight: without a precomputed scale torchao
all-reduces one amax per weight at every all-gather, so after each optimizer step the training loop calls
:func:`precompute_float8_scales` (torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one fused norm, one
all-reduce for all weights), as TorchTitan does.
MFU is not reported for Float8 runs (the peak FLOP/s would be that of Float8, not of the dtype of the rest).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch
from torch import nn

from meshforge.config.schema import Float8
from meshforge.errors import ConfigError, optional_import

MIN_CAPABILITY = (8, 9)
TORCHAO_FOR_TORCH = {(2, 11): "0.18.0", (2, 12): "0.18.0", (2, 13): "0.18.0", (2, 14): "0.18.0"}
"""The torchao release for each torch minor (torch-free table). Source: torchao 0.17.0's and 0.18.0's
``torchao/__init__.py`` (their wheels) load their compiled extensions only on torch >= 2.11.0, and 0.18.0 dropped the
torch < 2.11 code paths (its release notes); 0.18.0 is the newest release on the registry; CI runs it with torch 2.13,
docs/benchmarks/compat.md with 2.11 and 2.14.1. torch 2.10 and older: torchao 0.16.0 (not supported here)."""


def torchao_install(torch_version: str) -> str:
    """The install command of the torchao that matches ``torch_version`` (e.g. ``2.11.0+cu130``)."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    pinned = TORCHAO_FOR_TORCH.get((major, minor), TORCHAO_FOR_TORCH[max(TORCHAO_FOR_TORCH)])
    return f"pip install torchao=={pinned}"


def torchao(module: str = "torchao.float8") -> Any:
    """``module`` of torchao, imported where used; absent: one line naming Float8 and the matching install."""
    return optional_import(module, "quantize.dense.float8.enable = true (Float8)", torchao_install(torch.__version__))


CPU_FLOAT8_WARNING = (
    "meshforge: warning: quantize.dense.float8.emulate = false on a CPU runs torch._scaled_mm's reference kernel "
    "(orders of magnitude slower); use --quantize.dense.float8.emulate auto (the default) or true"
)


def emulated(cfg: Float8, device_type: str) -> bool:
    """Whether Float8 matmuls are emulated: ``auto`` emulates on anything but CUDA (a CPU has no Float8 kernels)."""
    return cfg.emulate if isinstance(cfg.emulate, bool) else device_type != "cuda"


def resolve_emulation(cfg: Float8, device: torch.device) -> tuple[Float8, str]:
    """``cfg`` with ``emulate = auto`` resolved for ``device``, and the banner's words ("" when Float8 is off)."""
    if not cfg.enable:
        return cfg, ""
    on = emulated(cfg, device.type)
    why = "auto" if cfg.emulate == "auto" else "as configured"
    how = "emulated in high precision" if on else "torch._scaled_mm kernels"
    return dataclasses.replace(cfg, emulate=on), f"Float8 {cfg.recipe_name} {how} ({why})"


def check_float8_support(cfg: Float8, device: torch.device) -> None:
    """ValueError when Float8 is asked for on a GPU without Float8 matmuls (compute capability < 8.9); a one-line
    warning when real Float8 matmuls were asked for on a CPU (``torch._scaled_mm`` there is a reference kernel: a
    debug model's step takes minutes instead of a second)."""
    on = emulated(cfg, device.type)
    if cfg.enable and device.type == "cpu" and not on and os.environ.get("RANK", "0") == "0":
        print(CPU_FLOAT8_WARNING, file=sys.stderr, flush=True)
    if not cfg.enable or device.type != "cuda" or on:
        return
    capability = torch.cuda.get_device_capability(device)
    check_capability(capability, torch.cuda.get_device_name(device))


def check_capability(capability: tuple[int, int], name: str) -> None:
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"quantize.dense.float8.enable = true needs CUDA compute capability >= 8.9 but {name} has "
            f"{capability[0]}.{capability[1]}; set it to false (or quantize.dense.float8.emulate = true for tests)"
        )


def float8_filter(filter_fqns: list[str]) -> object:
    """The module filter: ``nn.Linear`` not named in ``filter_fqns`` with both dimensions multiples of 16."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(part in fqn for part in filter_fqns):
            return False
        out_features, in_features = module.weight.shape
        return out_features % 16 == 0 and in_features % 16 == 0

    return keep


def fsdp_float8_all_gather(cfg: Float8, *, fsdp: bool) -> bool:
    """Whether FSDP all-gathers the Float8 weights (tensorwise recipe under FSDP with the option on)."""
    return cfg.enable and fsdp and cfg.enable_fsdp_float8_all_gather and cfg.recipe_name == "tensorwise"


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """After an optimizer step: the next all-gathers' Float8 scales of every FSDP-sharded Float8 weight, in one
    all-reduce per model part (collective over the FSDP ranks)."""
    precompute = torchao().precompute_float8_dynamic_scale_for_fsdp
    for part in model_parts:
        precompute(part)


def apply_float8(model: nn.Module, cfg: Float8, *, fsdp: bool) -> list[str]:
    """Convert the eligible linear layers of ``model`` in place; returns the names of the converted layers. None is
    an error, except in a pipeline stage without transformer blocks (only the embedding or the filtered output)."""
    float8 = torchao()
    float8_linear = torchao("torchao.float8.float8_linear").Float8Linear
    config = float8.Float8LinearConfig.from_recipe_name(cfg.recipe_name)
    float8_all_gather = fsdp_float8_all_gather(cfg, fsdp=fsdp)
    emulate = emulated(cfg, "cuda" if torch.cuda.is_available() else "cpu")  # training resolved auto already
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=float8_all_gather)
    float8.convert_to_float8_training(model, module_filter_fn=float8_filter(cfg.filter_fqns), config=config)  # type: ignore[arg-type]
    converted = [name for name, module in model.named_modules() if isinstance(module, float8_linear)]
    blocks = getattr(model, "layers", None)
    if not converted and (blocks is None or len(blocks) > 0):  # a pipeline stage of no blocks has none to convert
        raise ConfigError(
            "quantize.dense.float8.enable = true but no linear layer qualifies (all are filtered by "
            f"quantize.dense.float8.filter_fqns = {cfg.filter_fqns} or have dimensions not divisible by 16)"
        )
    return converted
