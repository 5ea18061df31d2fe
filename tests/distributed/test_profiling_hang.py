"""Observability on 2 gloo ranks: profiler windows, per-rank logs, and hang reports when one rank stalls."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from launcher import free_port, run_ranks

from meshforge.config.schema import Job, Profiling
from meshforge.observability.hang import HANG_EXIT_CODE
from meshforge.observability.logs import rank_logging
from meshforge.observability.profiling import check_window, window_action

TINY = [
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--activation_checkpoint.mode",
    "none",
    "--training.mixed_precision_param",
    "float32",
]


def _train(overrides: list[str]) -> list[dict[str, Any]]:
    from meshforge.config.io import load_config
    from meshforge.train.loop import train

    return train(load_config(None, [*TINY, *overrides]))


def _trace_steps(path: Path) -> set[int]:
    events = json.loads(path.read_text())["traceEvents"]
    return {int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")}


@pytest.mark.distributed
def test_two_ranks_trace_only_the_window_and_log_per_rank(tmp_path: Path) -> None:
    # windows of 2 steps (1 warm-up + 1 traced): steps 2 and 4 are traced; the window ending at 6 > 5 steps is not
    profiling = ["--profiling.enable_profiling", "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1"]
    profiling += ["--profiling.profiler_active", "1", "--profiling.enable_memory_snapshot"]
    logs = ["--job.log_rank", "1", "--job.log_to_files"]
    run_ranks(_train, 2, ["--training.steps", "5", "--job.dump_folder", str(tmp_path), *profiling, *logs])

    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    for step in (2, 4):
        for rank in (0, 1):
            assert _trace_steps(traces / f"iteration_{step}" / f"rank_{rank}_trace.json") == {step}
            timeline = tmp_path / "memory_snapshot" / f"iteration_{step}" / f"rank_{rank}_memory_timeline.png"
            assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for rank in (0, 1):  # every rank writes its own file, whatever log_rank says
        log = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert f"rank {rank} of 2" in log
        assert [line.split()[1] for line in log.splitlines() if line.startswith("step ")] == ["1", "2", "3", "4", "5"]


def test_window_schedule_and_validation() -> None:
    cfg = Profiling(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2)
    actions = [window_action(step, cfg, last_step=10).name for step in range(1, 11)]
    assert actions == ["NONE", "WARMUP", "RECORD", "RECORD_AND_SAVE"] * 2 + ["NONE", "NONE"]
    with pytest.raises(ValueError, match="profiler_warmup"):
        check_window(Profiling(profile_freq=3, profiler_warmup=3, profiler_active=1))


def test_log_rank_keeps_stdout_off_the_console_but_in_the_file(tmp_path: Path, capsys) -> None:
    job = Job(dump_folder=str(tmp_path), log_rank="1", log_to_files=True)
    with rank_logging(job, 0, 2) as console:
        print("a metrics line")
        print("a warning", file=sys.stderr)
    assert not console
    out, err = capsys.readouterr()
    assert out == "" and err == "a warning\n"  # errors from any rank stay visible
    assert "a metrics line\na warning\n" in (tmp_path / "logs" / "rank_0.log").read_text()
    with pytest.raises(ValueError, match="bad layout"), rank_logging(job, 0, 2):
        raise ValueError("bad layout")
    assert "ValueError: bad layout" in (tmp_path / "logs" / "rank_0.log").read_text()  # the error that ended it
    with rank_logging(Job(log_rank="0-1"), 1, 2):
        print("two\nlines")
    assert capsys.readouterr().out == "[rank 1] two\n[rank 1] lines\n"
    with pytest.raises(ValueError, match=r"job\.log_rank"), rank_logging(Job(log_rank="first"), 0, 2):
        pass


def _stalling_rank(rank: int, port: int, folder: str, stall_rank: int, stall_step: int) -> None:
    """One rank of a 2-rank run; ``stall_rank`` sleeps (outside any collective) when it reaches ``stall_step``."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    log = open(Path(folder) / f"console_{rank}.txt", "w", buffering=1)  # noqa: SIM115 (the process ends in os._exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import torch

    torch.set_num_threads(1)
    import meshforge.train.loop as loop

    real_step = loop.train_step

    def stalled_train_step(state: Any) -> Any:
        if rank == stall_rank and state.step == stall_step:
            time.sleep(600)
        return real_step(state)

    loop.train_step = stalled_train_step
    code = 1
    try:
        _train(["--training.steps", "6", "--job.dump_folder", folder, "--comm.train_timeout_seconds", "5"])
        code = 0  # the hang went unnoticed: the test fails on the exit code
    finally:
        os._exit(code)


@pytest.mark.distributed
def test_stalled_rank_makes_every_rank_write_a_hang_report(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_stalling_rank, args=(r, port, str(tmp_path), 1, 3)) for r in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    elapsed = time.monotonic() - start
    assert [p.exitcode for p in procs] == [HANG_EXIT_CODE] * 2, (tmp_path / "console_0.txt").read_text()
    assert elapsed < 90

    waiting = (tmp_path / "hang" / "rank_0.txt").read_text()  # rank 0 waited in a collective and timed out
    assert "this rank: in training step 3; its collective failed" in waiting
    assert "Timed out" in waiting and "gloo:" in waiting  # the exception and the flight recorder's entries
    stalled = (tmp_path / "hang" / "rank_1.txt").read_text()  # rank 1 never reached the collective
    assert "this rank: in training step 3; its own collectives had not failed" in stalled
    assert "in stalled_train_step" in stalled and "time.sleep(600)" in stalled  # its main thread's stack
    assert "gloo:" in stalled  # its earlier collectives
    console = (tmp_path / "console_0.txt").read_text()
    assert f"{tmp_path / 'hang'}/rank_<R>.txt (2 of 2 ranks wrote theirs)" in console
    # torch's analyser lines the raw dumps up across ranks and names the rank that never joined
    analyser = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "-p", "rank_"]
    found = subprocess.run(
        [*analyser, str(tmp_path / "hang" / "flight_recorder")], capture_output=True, text=True, timeout=120
    )
    report = found.stdout + found.stderr  # it logs to stderr
    assert "Not all ranks joining collective" in report and "missing ranks: {1}" in report, report
