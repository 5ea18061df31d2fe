"""A 2-rank `meshforge train` whose prepared dataset is damaged mid-run (issue 48): every rank exits non-zero within
seconds (far below the 100 s collective timeout), the file is named once, and the last checkpoint is intact: after
the dataset is prepared again, training resumes from it and finishes (in one process: any data-parallel degree
resumes a checkpoint, and one start-up costs half of two)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshforge.checkpoint import store
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.tokenizer import REPO_ROOT

pytestmark = pytest.mark.distributed

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")
EXIT_BOUND_S = 30.0  # from the damage to the end of every rank (the collective timeout is 100 s)


def prepare_dataset(root: Path) -> Path:
    """One train shard (every batch reads it), no validation split needed."""
    rows = "".join(
        f'{{"text": "Emma {i} was {" ".join(["handsome and clever"] * (2 + i % 7))}"}}\n' for i in range(200)
    )
    (root / "in.jsonl").write_text(rows)
    out = root / "data"
    prepare([str(root / "in.jsonl")], out, PrepareOptions(tokenizer_path=TOKENIZER, val_docs=1))
    return out


def train(data: Path, run: Path, steps: int, nproc: int) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "meshforge", "train", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    argv += ["--model.flavor", "tiny"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps)]
    argv += [
        "--training.dataset",
        "prepared",
        "--training.dataset_path",
        str(data),
        "--model.tokenizer_path",
        TOKENIZER,
    ]
    argv += ["--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"]
    argv += ["--checkpoint.enable", "--checkpoint.interval", "2", "--metrics.progress_bar", "false"]
    argv += ["--job.dump_folder", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_dataset_damaged_mid_run_stops_every_rank_in_seconds_and_resumes(tmp_path: Path) -> None:
    data = prepare_dataset(tmp_path)
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoint"
    job = train(data, run, steps=10_000, nproc=2)
    deadline = time.monotonic() + 300
    while not store.complete_steps(checkpoints) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.complete_steps(checkpoints), job.communicate(timeout=60)[1][-3000:] if job.poll() is not None else ""
    shard = data / "train-00000.bin"
    os.truncate(shard, 0)  # a partial rsync, a second `data prepare` into the folder, a short file after a fault
    damaged = time.monotonic()
    try:
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    took = time.monotonic() - damaged
    assert job.returncode not in (0, None) and took < EXIT_BOUND_S, (job.returncode, took, err[-3000:])
    named = [line for line in err.splitlines() if str(shard) in line]
    assert len(named) == 1 and "meshforge data verify" in named[0], err[-3000:]
    assert "Traceback" not in err and "Bus error" not in err, err[-3000:]
    steps = store.complete_steps(checkpoints)
    assert steps, err[-3000:]

    shutil.rmtree(data)  # the fix the line gives: prepare it again
    assert prepare_dataset(tmp_path) == data
    last = steps[-1]
    resumed = train(data, run, steps=last + 2, nproc=1)  # one process resumes the 2-rank checkpoint (faster)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"step-{last}" in out + err and f"step-{last + 2}" in out + err, (out + err)[-3000:]
    assert store.complete_steps(checkpoints)[-1] == last + 2
