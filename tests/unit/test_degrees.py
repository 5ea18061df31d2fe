"""parallel/degrees.py: the degrees of a config resolved once, torch-free; training (ParallelDims) and the planner
(plan/layout.py) read them alike."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from meshforge.config.schema import JobConfig, Parallelism
from meshforge.errors import ConfigError
from meshforge.parallel.degrees import Degrees, degrees_from_config, resolve_dp_shard
from meshforge.parallel.dims import ParallelDims
from meshforge.plan.layout import layout_from_config

CASES = [
    (8, {}),
    (8, {"tensor_parallel_degree": 2, "context_parallel_degree": 2}),
    (24, {"pipeline_parallel_degree": 3, "tensor_parallel_degree": 2, "data_parallel_replicate_degree": 2}),
    (16, {"data_parallel_shard_degree": 4, "tensor_parallel_degree": 4}),
    (64, {"data_parallel_replicate_degree": 2, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 8}),
    (6, {"tensor_parallel_degree": 4}),  # not divisible
    (4, {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 3}),  # product != world
    (7, {"context_parallel_degree": 7}),
]


def par(**degrees: int) -> Parallelism:
    return Parallelism(**degrees)  # type: ignore[arg-type]


def test_minus_one_is_the_rest_of_the_world() -> None:
    d = degrees_from_config(par(tensor_parallel_degree=2, context_parallel_degree=2, pipeline_parallel_degree=2), 32)
    assert d == Degrees(pp=2, dp_replicate=1, dp_shard=4, cp=2, tp=2)
    assert (d.world_size, d.dp, d.fsdp_size, d.efsdp, d.non_data_parallel_size) == (32, 4, 8, 8, 8)
    assert d.fsdp_enabled
    assert resolve_dp_shard(par(data_parallel_replicate_degree=3), 12) == 4
    assert resolve_dp_shard(par(data_parallel_shard_degree=5), 12) == 5, "an explicit degree is kept as given"
    one = degrees_from_config(par(), 1)
    assert one == Degrees(1, 1, 1, 1, 1) and not one.fsdp_enabled and one.dp == 1


@pytest.mark.parametrize(
    ("world", "degrees", "match"),
    [
        (2, {"tensor_parallel_degree": 0}, r"parallelism.tensor_parallel_degree = 0 must be >= 1"),
        (2, {"pipeline_parallel_degree": 0}, r"parallelism.pipeline_parallel_degree = 0 must be >= 1"),
        (2, {"data_parallel_shard_degree": -2}, r"data_parallel_shard_degree = -2 must be >= 1 or -1"),
        (2, {"data_parallel_shard_degree": 0}, r"data_parallel_shard_degree = 0 must be >= 1 or -1"),
        (6, {"tensor_parallel_degree": 4}, r"the world size 6 is not divisible by .* = 4; change the degrees or the"),
        (4, {"data_parallel_shard_degree": 3}, r"= 3 but the world size is 4; make the product equal"),
        (8, {"expert_parallel_degree": 3}, r"expert_parallel_degree = 3 must divide"),
        (8, {"expert_parallel_degree": 0}, r"expert_parallel_degree = 0 must be >= 1"),
    ],
)
def test_bad_degrees_are_one_line_config_errors(world: int, degrees: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        degrees_from_config(par(**degrees), world)
    assert len(str(err.value).splitlines()) == 1


def test_the_planner_names_its_world_size_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--world-size 6 is not divisible by .*; change the degrees or the world"):
        resolve_dp_shard(par(tensor_parallel_degree=4), 6, world="--world-size", fix="the world size")


def _planner(world: int, degrees: dict[str, int]) -> tuple[int, ...] | str:
    cfg = dataclasses.replace(JobConfig(), parallelism=par(**degrees))
    try:
        lay = layout_from_config(cfg, world)
    except ConfigError:
        return "ConfigError"
    return (lay.pp, lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, lay.world_size, lay.dp, lay.fsdp_size, lay.efsdp)


def _training(world: int, degrees: dict[str, int]) -> tuple[int, ...] | str:
    try:
        d = ParallelDims.from_config(par(**degrees), world)
    except ConfigError:
        return "ConfigError"
    return (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.world_size, d.dp, d.fsdp_size, d.efsdp)


@pytest.mark.parametrize(("world", "degrees"), CASES)
def test_training_and_planner_resolve_alike(world: int, degrees: dict[str, int]) -> None:
    assert _planner(world, degrees) == _training(world, degrees)


def test_degrees_import_no_torch() -> None:
    code = "import sys, meshforge.parallel.degrees; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
