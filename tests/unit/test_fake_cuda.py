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
    assert row["stream_ops"]["host_register"] > 0  # activation offload's pool, page-locked exactly


def test_activation_offload_cuda_path(results: dict[str, dict[str, object]]) -> None:
    """Two micro-steps over one pool, two blocks' activations and a weight each. Pack: into the page-locked pool (no
    torch pinned allocation: its caching host allocator rounds to powers of two and never frees), the side stream
    waits for the compute stream, the copy out is non-blocking, the tensor recorded on the side stream; the weight is
    not copied. Unpack in backward's order: the later block's waits for its copy out and copies back on the compute
    stream, having started the earlier block's copy back on the prefetch stream (after that copy out's event), whose
    unpack waits for the prefetch's event and records the tensor on the compute stream; the context's end waits for
    both streams. The pool is page-locked in the first micro-step only (a 64 MiB growth slab, then one of exactly
    the bytes taken: one event synchronisation), reused by the second."""
    row = results["activation_offload_hooks"]
    assert row["packed_on_host"] and row["weight_kept"] and row["round_trip"] and row["pinned"] == 0
    first, second = row["micro_steps"]  # type: ignore[misc]
    assert first["after_pack"] == {"host_register": 1, "wait_stream": 2, "record_stream": 2}
    grown = {"host_register": 2, "host_unregister": 1, "event_synchronize": 1}
    assert first["after_unpack"] == {"wait_stream": 4, "record_stream": 3, "wait_event": 3, **grown}
    assert second["after_pack"] == {"wait_stream": 2, "record_stream": 2}
    assert second["after_unpack"] == {"wait_stream": 4, "record_stream": 3, "wait_event": 3}
    for micro in (first, second):
        assert micro["copies"] == {"d2h_non_blocking": 2, "h2d_non_blocking": 2}
    assert row["pool_slabs"] == 1 and row["pool_bytes"] == 2 * 512  # two fp32 4 x 8 tensors (128 B), 512-aligned
    assert row["host_syncs"] == {}


def test_no_host_synchronisation_in_a_step_without_logging(results: dict[str, dict[str, object]]) -> None:
    for name in REACHING:
        syncs = results[name]["host_syncs"]
        assert isinstance(syncs, dict)
        assert not any(syncs.get(phase, 0) for phase in ("forward", "clip", "optimizer")), (name, syncs)
