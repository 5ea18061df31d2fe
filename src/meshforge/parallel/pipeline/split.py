"""Pipeline stage layout: which modules each stage holds, and which pipeline rank runs each stage.

A Llama model runs its top-level modules in one fixed order: ``tok_embeddings, layers.0 .. layers.N-1, norm, output``.
A stage is a contiguous slice of that order. The default split balances blocks evenly, counting the embedding as
``pipeline_parallel_first_stage_less_layers`` blocks and norm + output as ``pipeline_parallel_last_stage_less_layers``
blocks (they are heavy: a vocab-sized matmul), so the first and last stages get fewer transformer blocks.

Stages map onto pipeline ranks either looped (stage s on rank s % pp: interleaved schedules) or V-shaped (stages i and
2p-1-i on rank i: ZBV and DualPipeV, so the first and last stage share rank 0).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from meshforge.config.schema import Parallelism
from meshforge.errors import ConfigError
from meshforge.parallel.pipeline.catalog import Style

if TYPE_CHECKING:
    from torch import nn

ModelT = TypeVar("ModelT", bound="nn.Module")


def module_order(n_layers: int) -> list[str]:
    """The top-level modules of the model in the order its forward runs them."""
    return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]


def num_stages_for(cfg: Parallelism, n_layers: int, pp: int, style: Style) -> int:
    """Total stages of a config's pipeline (``count_stages`` of its parallelism section)."""
    return count_stages(
        n_layers,
        pp,
        style,
        explicit=len(cfg.module_fqns_per_model_part),
        layers_per_stage=cfg.pipeline_parallel_layers_per_stage,
        first_less=cfg.pipeline_parallel_first_stage_less_layers,
        last_less=cfg.pipeline_parallel_last_stage_less_layers,
    )


def count_stages(
    n_layers: int, pp: int, style: Style, *, explicit: int, layers_per_stage: int, first_less: int, last_less: int
) -> int:
    """Total stages: ``explicit`` module lists, else from layers_per_stage, else the schedule's default (1 or 2 per
    rank)."""
    if explicit:
        num_stages = explicit
        source = f"parallelism.module_fqns_per_model_part has {num_stages} stages"
    elif layers_per_stage > 0:
        num_stages = math.ceil((n_layers + first_less + last_less) / layers_per_stage)
        source = f"parallelism.pipeline_parallel_layers_per_stage = {layers_per_stage} gives {num_stages} stages"
    else:
        return pp if style == "single" else 2 * pp
    check_stages_per_rank(num_stages, pp, style, source)
    return num_stages


def check_stages_per_rank(num_stages: int, pp: int, style: Style, source: str) -> None:
    """Single-stage schedules need exactly 1 stage per rank, V-shaped ones exactly 2, looped ones at least 2."""
    if num_stages % pp:
        raise ConfigError(
            f"{source}, not a multiple of pipeline_parallel_degree = {pp}; change it so every rank gets as many stages"
        )
    per_rank = num_stages // pp
    need = {"single": "exactly 1", "v": "exactly 2", "loop": "at least 2"}[style]
    if (style == "single" and per_rank != 1) or (style == "v" and per_rank != 2) or (style == "loop" and per_rank < 2):
        raise ConfigError(
            f"{source} = {per_rank} per rank, but this schedule needs {need} stage(s) per rank; change "
            "pipeline_parallel_layers_per_stage / module_fqns_per_model_part or the schedule"
        )


def split_evenly(n_layers: int, num_stages: int, first_less: int, last_less: int) -> list[list[str]]:
    """Module names per stage: blocks spread evenly, embedding and norm + output weighted as blocks."""
    if num_stages == 1:
        return [module_order(n_layers)]
    effective = n_layers + first_less + last_less
    if num_stages > effective:
        raise ConfigError(
            f"the pipeline needs {num_stages} stages but the model has only {n_layers} layers (+ {first_less} + "
            f"{last_less} for embedding and output); lower pipeline_parallel_degree or use fewer stages per rank"
        )
    base, extra = divmod(effective, num_stages)
    if first_less > base or last_less > base:
        raise ConfigError(
            f"pipeline_parallel_first/last_stage_less_layers = {first_less}/{last_less} exceed the {base} blocks per "
            f"stage of {num_stages} stages over {n_layers} layers; lower them or use fewer stages"
        )
    stages: list[list[str]] = []
    next_layer = 0
    for index in range(num_stages):
        budget = base + (1 if index < extra else 0)
        names = ["tok_embeddings"] if index == 0 else []
        budget -= first_less if index == 0 else 0
        budget -= last_less if index == num_stages - 1 else 0
        take = min(budget, n_layers - next_layer)
        names += [f"layers.{i}" for i in range(next_layer, next_layer + take)]
        next_layer += take
        if index == num_stages - 1:
            names += ["norm", "output"]
        stages.append(names)
    return stages


def validate_stage_modules(stages: list[list[str]], n_layers: int) -> None:
    """Every module exactly once, each stage a contiguous slice in forward order, no empty stage."""
    order = module_order(n_layers)
    position = {name: i for i, name in enumerate(order)}
    flat: list[str] = []
    for index, names in enumerate(stages):
        if not names:
            raise ConfigError(f"parallelism.module_fqns_per_model_part: stage {index} is empty; give it a module")
        unknown = [n for n in names if n not in position]
        if unknown:
            raise ConfigError(
                f"parallelism.module_fqns_per_model_part: stage {index} names {unknown!r}, which the model does not "
                f"have; use tok_embeddings, layers.0 .. layers.{n_layers - 1}, norm, output"
            )
        flat += sorted(names, key=position.__getitem__)
    if flat != order:
        missing = sorted(set(order) - set(flat), key=position.__getitem__)
        twice = sorted({n for n in flat if flat.count(n) > 1}, key=position.__getitem__)
        raise ConfigError(
            f"parallelism.module_fqns_per_model_part must list every module once, stage after stage in forward order "
            f"(missing {missing}, repeated {twice}); fix the lists"
        )


def stage_modules(cfg: Parallelism, n_layers: int, num_stages: int) -> list[list[str]]:
    """The validated module names of every stage of a config's pipeline (``split_stages`` of its section)."""
    return split_stages(
        n_layers,
        num_stages,
        explicit=cfg.module_fqns_per_model_part,
        first_less=cfg.pipeline_parallel_first_stage_less_layers,
        last_less=cfg.pipeline_parallel_last_stage_less_layers,
    )


def split_stages(
    n_layers: int, num_stages: int, *, explicit: Sequence[Sequence[str]], first_less: int, last_less: int
) -> list[list[str]]:
    """The validated module names of every stage (``explicit`` ones, else the even split)."""
    if explicit:
        stages = [list(names) for names in explicit]
    else:
        if first_less < 0 or last_less < 0:
            raise ConfigError(
                f"pipeline_parallel_first/last_stage_less_layers = {first_less}/{last_less} must be >= 0; set them "
                "to 0 or more"
            )
        stages = split_evenly(n_layers, num_stages, first_less, last_less)
    validate_stage_modules(stages, n_layers)
    return stages


def stage_to_rank(num_stages: int, pp: int, style: Style) -> dict[int, int]:
    """Pipeline rank of every stage: looped (s % pp) or V-shaped (i and 2p-1-i together)."""
    if style != "v":
        return {s: s % pp for s in range(num_stages)}
    return {s: s if s < pp else 2 * pp - 1 - s for s in range(num_stages)}


def prune_to_stage(model: ModelT, keep: list[str]) -> ModelT:
    """A copy of the (meta-device) model holding only the named modules; the others become None or are deleted."""
    part = copy.deepcopy(model)
    kept_layers = {name.split(".", 1)[1] for name in keep if name.startswith("layers.")}
    layers: nn.ModuleDict = part.layers  # type: ignore[assignment]
    for key in list(layers.keys()):
        if key not in kept_layers:
            del layers[key]
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(part, name, None)
    return part
