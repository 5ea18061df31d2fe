"""The fake-CUDA check (scripts/fake_cuda_check.py) from pytest: meshforge's layouts on fake cuda tensors with a
guard on every collective's devices and a count of host synchronisations. It needs torch's CUDA build: the Python of
``$MESHFORGE_FAKE_CUDA_PYTHON`` or of ``.venv-fake-cuda`` (`make test-fake-cuda` makes it: torch 2.14.1+cu130 from
this machine's disk, ~110 s; .ci/run builds it first); without either it skips in one line (see
docs/benchmarks/compat.md). ~30 s when it runs."""

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


STEP = ("setup", "forward", "clip", "optimizer", "log")
"""The phases of the real first step (``run_steps``: train_step, log, save) these layouts pass on fake CUDA."""
REACHING = ("dense_fsdp4", "dense_tp2", "dense_cp2_allgather", "dense_cp2_ring", "dense_fsdp2_offload")


def test_layouts_run_the_real_step_as_far_as_torch_allows(results: dict[str, dict[str, object]]) -> None:
    """How far torch goes today (module docstring of the script): set-up, forward, clip, optimizer and log of the
    real train_step; backward stops in the autograd engine (it asks the CUDA driver for a primary context; zero
    gradients stand in so the later phases run) and the save in DCP's write (.numpy() of a fake tensor). Each row
    names the first failure with torch's message; layouts whose set-up stops are listed with theirs."""
    for name in REACHING:
        row = results[name]
        assert row["phases"] == list(STEP), (name, row)
        assert str(row["stopped"]).startswith("backward: RuntimeError: hasPrimaryContext"), (name, row["stopped"])
        assert row["collectives"] > 0
    for name, row in results.items():
        if "phases" in row and row["phases"] != list(STEP):
            assert row["stopped"] and ": " in str(row["stopped"]), (name, row)  # where and torch's message
    assert results["dense_stage_moe_balance"]["reached"] == "balance"


def test_the_whole_step_runs_under_the_meta_outer_wrapper(results: dict[str, dict[str, object]]) -> None:
    """One process, parameters and buffers wrapped (outer tensor on meta, inner fake CUDA): the autograd engine runs
    backward, fused AdamW steps, the log step reads on the host; only DCP's write stops (.numpy() of a subclass)."""
    row = results["dense_1_meta_outer"]
    assert row["phases"] == ["setup", "forward", "backward", "clip", "optimizer", "log"], row
    assert str(row["stopped"]).startswith("save: RuntimeError: .numpy()"), row["stopped"]
    syncs = row["host_syncs"]
    assert isinstance(syncs, dict) and not any(syncs.get(p, 0) for p in ("forward", "backward", "clip", "optimizer"))
    assert syncs.get("log", 0) > 0


def test_cpu_offload_uses_the_host_backend_beside_the_device_one(results: dict[str, dict[str, object]]) -> None:
    row = results["dense_fsdp2_offload"]
    assert row["backend"] == "cuda:nccl,cpu:gloo" and row["host_collectives"] > 0  # clip's norm over host shards
    assert row["pinned"] > 0  # pinned host buffers (FSDP's shards, activation offload's saves)


def test_activation_offload_cuda_path(results: dict[str, dict[str, object]]) -> None:
    """Pack: a pinned buffer, the side stream waits for the compute stream, the copy out is non-blocking, the tensor
    is recorded on the side stream; the compute stream does not wait. Unpack: it waits for the copy's event (on the
    device) and copies back non-blocking. No host synchronisation."""
    row = results["activation_offload_hooks"]
    assert row["packed_on_host"] and row["round_trip"] and row["pinned"] == 1
    assert row["after_pack"] == {"wait_stream": 1, "record_stream": 1}
    assert row["after_unpack"] == {"wait_stream": 1, "record_stream": 1, "wait_event": 1}
    assert row["copies"] == {"d2h_non_blocking": 1, "h2d_non_blocking": 1} and row["host_syncs"] == {}


def test_no_host_synchronisation_in_a_step_without_logging(results: dict[str, dict[str, object]]) -> None:
    for name in REACHING:
        syncs = results[name]["host_syncs"]
        assert isinstance(syncs, dict)
        assert not any(syncs.get(phase, 0) for phase in ("forward", "clip", "optimizer")), (name, syncs)
