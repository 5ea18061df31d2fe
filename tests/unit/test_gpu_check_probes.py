"""scripts/gpu_check_probes.py's CP probe on CPU (gloo, 2 forked ranks): each case isolated, so a failing ring case
leaves the all-gather results standing and turns the probe's verdict false; ring under gloo on CUDA is skipped in one
line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from launcher import run_ranks

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def load_probes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_probes", REPO / "scripts" / "gpu_check_probes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check_probes"] = module
    spec.loader.exec_module(module)
    return module


probes = load_probes()
SEQ = 64


def cp_on_cpu() -> dict[str, Any]:
    return probes.cp_attention([SEQ], "cpu")  # type: ignore[no-any-return]


def test_both_cp_cores_match_dense_attention_on_cpu() -> None:
    result = run_ranks(cp_on_cpu, 2)[0]
    assert result["correct"] is True and result["backend"] == "gloo", result
    for impl in ("allgather", "ring"):
        errors = result[f"{impl}_seq{SEQ}"]
        assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) <= probes.CP_TOLERANCE


def test_a_failing_ring_case_leaves_the_all_gather_results(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ring, _ = probes.cp_cores()

    def broken(self: object, *args: object) -> None:
        raise RuntimeError("planted ring failure")

    monkeypatch.setattr(ring, "forward", broken)  # before the fork: both ranks fail the same case
    result = run_ranks(cp_on_cpu, 2)[0]
    assert result[f"ring_seq{SEQ}"] == "failed: RuntimeError: planted ring failure"
    gathered = result[f"allgather_seq{SEQ}"]
    assert isinstance(gathered, dict) and max(gathered.values()) <= probes.CP_TOLERANCE
    assert result["cases_failed"] is True and result["correct"] is False


def test_ring_is_skipped_only_for_gloo_on_cuda() -> None:
    assert probes.ring_unsupported("cuda", "gloo")
    assert not probes.ring_unsupported("cuda", "nccl") and not probes.ring_unsupported("cpu", "gloo")
    assert probes.RING_ON_GLOO_CUDA.startswith("skipped: ") and "\n" not in probes.RING_ON_GLOO_CUDA
