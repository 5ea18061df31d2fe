"""parallel/cpu_offload.py: the policy, the backend beside NCCL, host parameters with device buffers, the refusal."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from meshforge.errors import ConfigError
from meshforge.model.hf_config import model_args_for
from meshforge.model.llama import build_model
from meshforge.parallel.cpu_offload import banner, check_cpu_offload, materialize, offload_policy
from meshforge.parallel.distributed import process_group_backend


def test_policy_pins_memory_on_cuda_only() -> None:
    assert offload_policy(True, "cuda") == CPUOffloadPolicy(pin_memory=True)
    assert offload_policy(True, "cpu") == CPUOffloadPolicy(pin_memory=False)
    assert type(offload_policy(False, "cuda")) is OffloadPolicy


def test_backend_adds_gloo_beside_nccl_under_offload() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert process_group_backend(cuda, "nccl", True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(cuda, "nccl", False) == "nccl"
    assert process_group_backend(cuda, "gloo", True) == "gloo"
    assert process_group_backend(cpu, "nccl", True) == "gloo"


def test_materialize_keeps_parameters_on_the_host_and_buffers_on_the_device() -> None:
    from meshforge.config.io import load_config

    model = build_model(model_args_for(load_config(None, ["--model.flavor", "tiny"]), 2048))
    device = torch.device("meta")  # any non-CPU device shows the split
    materialize(model, device, cpu_offload=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    materialize(model, device, cpu_offload=False)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_offload_without_fsdp_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"needs FSDP.*data_parallel_shard_degree >= 2"):
        check_cpu_offload(True, fsdp_enabled=False)
    check_cpu_offload(True, fsdp_enabled=True)
    check_cpu_offload(False, fsdp_enabled=False)


def test_banner_says_no_memory_moves_on_a_cpu() -> None:
    assert "no-op for memory on a CPU-only machine" in banner(True, torch.device("cpu"))
    assert "on the host" in banner(True, torch.device("cuda")) and banner(False, torch.device("cuda")) == ""
