"""Async TP: the TP group gets symmetric memory (without it inductor's micro-pipeline pass does nothing), the
options it needs are checked up front (dry run too), and the planner credits meshforge's async TP no overlap."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
from torch.distributed.device_mesh import init_device_mesh

from meshforge.cli import main as cli_main
from meshforge.config.io import ConfigError
from meshforge.config.schema import Float8, Parallelism
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.tensor_parallel import enable_async_tp
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout
from meshforge.plan.physics.estimate import estimate

ASYNC = Parallelism(enable_async_tensor_parallel=True, tensor_parallel_degree=2)
CUDA = torch.device("cuda")


def tp2() -> ParallelDims:
    return ParallelDims.from_config(Parallelism(tensor_parallel_degree=2), 2)


def test_async_tp_needs_sequence_parallel_and_compile() -> None:
    no_sp = dataclasses.replace(ASYNC, enable_sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"needs parallelism\.enable_sequence_parallel = true"):
        tp2().validate_features(no_sp, device=CUDA, compile_enabled=True, float8=Float8())
    with pytest.raises(ConfigError, match=r"needs compile\.enable = true"):
        tp2().validate_features(ASYNC, device=CUDA, compile_enabled=False, float8=Float8())
    with pytest.raises(ConfigError, match="needs CUDA symmetric memory, the device is cpu"):
        tp2().validate_features(ASYNC, device=torch.device("cpu"), compile_enabled=True, float8=Float8())
    tp2().validate_features(ASYNC, device=CUDA, compile_enabled=True, float8=Float8())  # all there: accepted


def test_dry_run_catches_async_tp_without_sequence_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--dry-run", "--world-size", "2", "--model.flavor", "tiny", "--compile.enable", "true"]
    argv += ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel", "true"]
    assert cli_main([*argv, "--parallelism.enable_sequence_parallel", "false"]) == 2
    assert "enable_sequence_parallel = true" in capsys.readouterr().err


def test_enable_async_tp_registers_the_tp_group(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    before = torch._inductor.config._micro_pipeline_tp  # type: ignore[attr-defined]
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        name = mesh.get_group().group_name
        assert not is_symm_mem_enabled_for_group(name)  # what made the old code a no-op
        enable_async_tp(mesh)
        assert is_symm_mem_enabled_for_group(name)
        assert torch._inductor.config._micro_pipeline_tp  # type: ignore[attr-defined]
    finally:
        torch._inductor.config._micro_pipeline_tp = before  # type: ignore[attr-defined]
        dist.destroy_process_group()


def test_planner_credits_meshforge_async_tp_no_overlap() -> None:
    hw = load_hardware("h100")
    base = Layout(flavor="8B", seq_len=8192, local_batch_size=1, dp_shard=4, tp=2, compile=True)

    def tp_seconds(**changes: object) -> float:
        return float(estimate(dataclasses.replace(base, **changes), hw).time["exposed_tp_comm"])  # type: ignore[arg-type]

    assert tp_seconds(async_tp=True) == pytest.approx(tp_seconds(async_tp=False))
    overlap = tp_seconds(async_tp=True, impl="torchtitan") / tp_seconds(async_tp=False, impl="torchtitan")
    assert overlap == pytest.approx(1 - hw.efficiency.async_tp_overlap)  # TorchTitan's measured overlap stays
