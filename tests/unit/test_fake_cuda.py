"""The fake-CUDA check (scripts/fake_cuda_check.py) from pytest: meshforge's layouts on fake cuda tensors with a
guard on every collective's devices and a count of host synchronisations. It needs torch's CUDA build: the Python of
``$MESHFORGE_FAKE_CUDA_PYTHON`` or of ``.venv-fake-cuda`` (`make test-fake-cuda` makes it: torch 2.14.1+cu130 from
this machine's disk, ~110 s; .ci/run builds it first); without either it skips in one line (see
docs/benchmarks/compat.md). ~15 s when it runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def fake_cuda_python() -> str | None:
    explicit = os.environ.get("MESHFORGE_FAKE_CUDA_PYTHON", "")
    if explicit and Path(explicit).is_file():
        return explicit
    venv = REPO / ".venv-fake-cuda"  # complete only once scripts/fake_cuda_venv.sh wrote .ready
    return str(venv / "bin/python") if (venv / ".ready").is_file() else None


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    python = fake_cuda_python()
    if python is None:
        pytest.skip("fake-CUDA check: no CUDA build of torch here (make test-fake-cuda, or MESHFORGE_FAKE_CUDA_PYTHON)")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [python, "scripts/fake_cuda_check.py"], capture_output=True, text=True, timeout=240, cwd=REPO, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["layout"]: row for row in rows}


def test_no_collective_gets_a_non_cuda_tensor(results: dict[str, dict[str, object]]) -> None:
    for name, row in results.items():
        assert row["non_cuda_collectives"] == [], name


def test_layouts_reach_the_checkpoint_save_on_fake_cuda(results: dict[str, dict[str, object]]) -> None:
    """How far torch goes today (module docstring of the script): setup, forward, log on fake cuda; the save stops
    inside DCP's planning. Layouts whose set-up stops earlier are listed in docs/benchmarks/compat.md."""
    for name in ("dense_fsdp4", "dense_cp2_allgather", "dense_cp2_ring"):
        assert results[name]["reached"] == "save", results[name]
        assert results[name]["collectives"] > 0
    assert results["dense_stage_moe_balance"]["reached"] == "balance"


def test_no_host_synchronisation_in_forward_or_on_a_step_without_logging(results: dict[str, dict[str, object]]) -> None:
    for name in ("dense_fsdp4", "dense_cp2_allgather", "dense_cp2_ring"):
        syncs = results[name]["host_syncs"]
        assert isinstance(syncs, dict)
        assert syncs.get("forward", 0) == 0 and syncs.get("step_without_log", 0) == 0, (name, syncs)
        assert 0 < syncs.get("log", 0) <= 3, (name, syncs)  # peak memory, loss, grad norm: on log steps only
