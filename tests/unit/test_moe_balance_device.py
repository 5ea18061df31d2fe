"""train/moe_balance.py on a pipeline stage without MoE layers: the stage still joins the stages' max of the expert
load, and the tensor it hands the pipeline group's collective must be on the backend's device (NCCL: CUDA), not the
host zero it starts from. A fake NCCL backend on the CPU, as tests/unit/test_device.py does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshforge.train.moe_balance import balance_experts


class FakeMesh:
    def get_group(self) -> Any:
        return "pp-group"


def test_stage_without_moe_layers_reduces_on_the_nccl_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    dense_stage = nn.Linear(4, 4)
    if torch.cuda.is_available():
        assert balance_experts([dense_stage], None, FakeMesh(), coeff=1e-3) == {"moe_max_load": 0.0}  # type: ignore[arg-type]
        assert [d.type for d in seen] == ["cuda"]
    else:  # the tensor is moved to CUDA, which this build lacks: it never reaches all_reduce as a CPU tensor
        with pytest.raises((AssertionError, RuntimeError), match=r"(?i)cuda"):
            balance_experts([dense_stage], None, FakeMesh(), coeff=1e-3)  # type: ignore[arg-type]
        assert seen == [], f"a {seen[0]} tensor reached the NCCL group's all_reduce"


def test_stage_without_moe_layers_keeps_a_host_zero_for_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    assert balance_experts([nn.Linear(4, 4)], None, FakeMesh(), coeff=0.0) == {"moe_max_load": 0.0}  # type: ignore[arg-type]
    assert seen == [torch.device("cpu")]
