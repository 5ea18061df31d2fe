"""Every background worker, made to raise (issue 48): its failure reaches whoever waits on it as one line naming the
worker, within the wait's bound; no thread dies unseen (pyproject's filterwarnings makes an unhandled thread exception
fail the test that leaves it). The shard-check threads are made to raise and to stall in tests/unit/test_data_damage.py.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from meshforge.errors import BackgroundError, ConfigError
from meshforge.threads import Worker, result


class Injected(RuntimeError):
    pass


def boom(*args: Any, **kwargs: Any) -> Any:
    raise Injected("injected fault")


def test_a_worker_keeps_its_failure_and_finish_is_bounded() -> None:
    failed = Worker(boom, name="t-fail", what="the test worker")
    failed.start()
    with pytest.raises(BackgroundError, match=r"^the test worker failed: Injected: injected fault$"):
        failed.finish(5)
    stuck = Worker(lambda: time.sleep(3), name="t-stuck", what="the stuck worker")
    stuck.start()
    began = time.monotonic()
    with pytest.raises(BackgroundError, match=r"^the stuck worker did not stop within 0.2 s"):
        stuck.finish(0.2)
    assert time.monotonic() - began < 1
    stuck.join()
    user = Worker(lambda: (_ for _ in ()).throw(ConfigError("a one-line mistake")), name="t-user", what="w")
    user.start()
    with pytest.raises(ConfigError, match=r"^a one-line mistake$"):  # a user mistake stays what it is
        user.finish(5)


def test_a_future_gives_one_line_and_a_bound() -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(BackgroundError, match=r"^the job failed: Injected: injected fault$") as caught:
            result(pool.submit(boom), "the job")
        assert isinstance(caught.value.__cause__, Injected)  # the worker's traceback is kept
        with pytest.raises(BackgroundError, match=r"^the slow job did not finish within 0.1 s$"):
            result(pool.submit(time.sleep, 1), "the slow job", timeout=0.1)


def test_the_load_sampler_reports_its_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshforge.bench import machine

    monkeypatch.setattr(machine, "load_average", boom)
    began = time.monotonic()
    sampler = machine.LoadSampler(interval_s=0.05)
    with pytest.raises(BackgroundError, match=r"^the bench's load sampler failed: Injected: injected fault$"), sampler:
        time.sleep(0.1)
    with pytest.raises(BackgroundError, match="load sampler failed"):
        sampler.summary()
    assert time.monotonic() - began < 5


class Weights:
    """A Stateful of one tensor."""

    def __init__(self) -> None:
        self.w = torch.arange(4.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.w = state["w"]


def checkpointer(folder: Path, **cfg: Any) -> Any:
    from meshforge.checkpoint.dcp import Checkpointer
    from meshforge.config.schema import Checkpoint

    section = Checkpoint(**{"enable": True, "interval": 1, **cfg})
    return Checkpointer(
        section,
        dump_folder=str(folder),
        total_steps=10,
        info={},
        device=torch.device("cpu"),
        timeout_s=60,
        console=False,
    )


def test_the_checkpoint_writer_reports_its_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshforge.checkpoint import store

    monkeypatch.setattr(store, "write_checkpoint", boom)
    ck = checkpointer(tmp_path, async_mode="async")
    began = time.monotonic()
    ck.save({"model": Weights()}, 2)  # returns at once: the write runs on the checkpoint thread
    with pytest.raises(BackgroundError, match=r"^the background checkpoint save of step 2 \(rank 0\) failed: Inj"):
        ck.wait()
    assert time.monotonic() - began < 10
    ck.close()


def test_the_checkpoint_pruner_reports_its_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshforge.checkpoint import store

    monkeypatch.setattr(store, "prune", boom)
    ck = checkpointer(tmp_path, keep_latest_k=1)
    ck.save({"model": Weights()}, 1)  # the deletion runs on rank 0's pruning thread
    assert ck.pruning is not None
    concurrent.futures.wait([ck.pruning], timeout=10)
    with pytest.raises(BackgroundError, match=r"^the deletion of old checkpoints in \S+ \(rank 0's pruning thread\) f"):
        ck.save({"model": Weights()}, 2)  # the next save reports it (before writing), not only close()
    ck.pruning = None
    ck.close()


def test_the_hang_watchdog_reports_its_failure(tmp_path: Path) -> None:
    import torch.distributed as dist
    from launcher import free_port

    from meshforge.observability.hang import POLL_SECONDS, HangGuard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        guard = HangGuard(str(tmp_path), 0, 1, status=lambda: "step 1")
        guard._report = boom  # type: ignore[method-assign]  # writing the report fails (a full disk, a bug)
        began = time.monotonic()
        failed = pytest.raises(BackgroundError, match=r"^rank 0's hang watchdog failed: Injected: injected fault$")
        with failed, guard:
            assert guard.store is not None
            guard.store.set("flag", "rank 1: a peer's collective timed out")
            time.sleep(POLL_SECONDS * 2.5)  # the watchdog sees the flag and fails
        assert time.monotonic() - began < POLL_SECONDS * 2.5 + 5
    finally:
        dist.destroy_process_group()


def _killed(texts: list[str], dtype: str) -> Any:
    """An encoder worker killed mid-batch (the out-of-memory killer)."""
    os._exit(9)


def test_a_killed_prepare_worker_is_one_line_not_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mp.Pool replaced a dead worker and waited for its lost result forever; the executor breaks and says so."""
    from meshforge.data import prepare
    from meshforge.data.tokenizer import REPO_ROOT

    (tmp_path / "in.jsonl").write_text("".join(f'{{"text": "Emma {i} was handsome"}}\n' for i in range(20)))
    monkeypatch.setattr(prepare, "_encode_in_worker", _killed)  # the spawned workers import it from this module
    options = prepare.PrepareOptions(tokenizer_path=str(REPO_ROOT / "data/tokenizer/austen-bpe-2048.json"), workers=2)
    began = time.monotonic()
    with pytest.raises(BackgroundError, match=r"^a `data prepare` encoder process \(one of 2\) failed: BrokenProc"):
        prepare.prepare([str(tmp_path / "in.jsonl")], tmp_path / "out", options)
    assert time.monotonic() - began < 120
