"""Rank 0 deletes old checkpoints off the critical path: a save returns while the deletion still runs, and the
deletion still happens (close waits for it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from test_checkpoint_store import checkpointer, make_state, take_steps

from meshforge.checkpoint import store
from meshforge.train.loop import checkpoint_states


def test_pruning_runs_in_the_background_and_still_happens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    threads: list[str] = []
    real_prune = store.prune

    def slow_prune(folder: Path, keep: int) -> list[int]:  # a deletion of terabytes
        threads.append(threading.current_thread().name)
        release.wait(timeout=30)
        return real_prune(folder, keep)

    monkeypatch.setattr(store, "prune", slow_prune)
    state = make_state(seed=1)
    ck = checkpointer(tmp_path, keep_latest_k=2)
    start = time.perf_counter()
    for _ in range(3):
        take_steps(state, 2)
        ck.maybe_save(checkpoint_states(state), state.step)  # returns although the deletion is blocked
    assert time.perf_counter() - start < 25
    assert store.complete_steps(tmp_path / "checkpoint") == [2, 4, 6]  # nothing deleted yet
    release.set()
    ck.close()
    assert store.complete_steps(tmp_path / "checkpoint") == [4, 6]
    assert threads and all(name.startswith("meshforge-checkpoint-prune") for name in threads)


def test_no_pruner_thread_when_everything_is_kept(tmp_path: Path) -> None:
    state = make_state(seed=1)
    ck = checkpointer(tmp_path)
    take_steps(state, 2)
    ck.maybe_save(checkpoint_states(state), state.step)
    assert ck.pruner is None
    ck.close()
