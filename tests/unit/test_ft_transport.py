"""The cross-group all-reduce's transport is chosen by where the gradients live, in one place
(train/fault_tolerance.py ``replica_process_group``): torchft's NCCL group on CUDA, gloo on the host (a CPU run, or
gradients on the host under FSDP CPU offload)."""

from __future__ import annotations

import datetime

import pytest
import torch

from meshforge.config.io import load_config

torchft = pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")


def chosen(device: str, monkeypatch: pytest.MonkeyPatch) -> str:
    from torchft import process_group

    from meshforge.train.fault_tolerance import replica_process_group

    for name in ("ProcessGroupNCCL", "ProcessGroupGloo", "ProcessGroupXCCL"):  # no NCCL on this machine: record
        monkeypatch.setattr(process_group, name, lambda timeout, name=name: name)
    return str(replica_process_group(torch.device(device), datetime.timedelta(seconds=5)))


def test_nccl_on_cuda_gloo_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen("cuda", monkeypatch) == "ProcessGroupNCCL"
    assert chosen("cpu", monkeypatch) == "ProcessGroupGloo"
    assert chosen("xpu", monkeypatch) == "ProcessGroupXCCL"


def test_cpu_offload_keeps_the_gradients_and_so_the_all_reduce_on_the_host() -> None:
    from meshforge.train.fault_tolerance import gradient_device

    cfg = load_config(None, [])
    assert gradient_device(cfg, torch.device("cuda")) == torch.device("cuda")
    offload = load_config(None, ["--training.enable_cpu_offload"])
    assert gradient_device(offload, torch.device("cuda")) == torch.device("cpu")
