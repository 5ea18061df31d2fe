"""Mistakes as `meshforge train --nproc N` meets them: found before any process starts (the dry run's real layout on a
fake process group, plus this machine's folders), reported once in one line with exit 2; what only the ranks can find
is printed once, and the launch ends with one line naming the failed rank and its exit code (no launcher traceback).
One-process runs give the same one-line errors for an unwritable checkpoint folder and an unknown compile backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshforge import cli
from meshforge.train import cli as train_cli

TINY = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "4"]
TINY += ["--training.steps", "2", "--metrics.progress_bar", "false", "--training.mixed_precision_param", "float32"]


def mistakes(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, what the one line must say)."""
    csv = tmp / "schedule.csv"
    csv.write_text("0F0,0F1,xyz\n1F0,1B0,1F1\n")
    blocker = tmp / "a-file"
    blocker.write_text("")
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--activation_checkpoint.mode", "none"]
    async_tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"]
    return {
        "unknown schedule": ([*pp2, "--parallelism.pipeline_parallel_schedule", "Bogus"], "'Bogus' is unknown"),
        "malformed csv": ([*pp2, "--parallelism.pipeline_parallel_schedule_csv", str(csv)], "'xyz' is not a compute"),
        # 16 pipeline ranks for the 8 layers of tiny (the test launches --nproc 16)
        "more stages than layers": (["--parallelism.pipeline_parallel_degree", "16"], "needs 16 stages but the model"),
        "async tp on cpu": ([*async_tp, "--compile.enable"], "async tensor parallel needs CUDA"),
        "unwritable checkpoint folder": (
            ["--checkpoint.enable", "--checkpoint.folder", str(blocker / "ckpt")],
            f"cannot write to {blocker}/ckpt",
        ),
        "unknown compile backend": (["--compile.enable", "--compile.backend", "bogus"], "'bogus' is not a torch"),
    }


@pytest.mark.parametrize(
    "name",
    ["unknown schedule", "malformed csv", "more stages than layers", "async tp on cpu", "unwritable checkpoint folder",
     "unknown compile backend"],
)  # fmt: skip
def test_mistakes_are_reported_once_before_launching(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides, says = mistakes(tmp_path)[name]

    def launch(nproc: int, argv: list[str]) -> int:
        raise AssertionError("launched despite the mistake")

    monkeypatch.setattr(train_cli, "launch_torchrun", launch)
    nproc = "16" if name == "more stages than layers" else "2"
    argv = ["train", "--nproc", nproc, *TINY, "--job.dump_folder", str(tmp_path / "run"), *overrides]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("meshforge train: config error: ") and says in err, err


def run_cli(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "meshforge", "train", *TINY, "--job.dump_folder", str(tmp / "run"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["unwritable checkpoint folder", "unknown compile backend"])
def test_one_process_mistakes_are_one_line(name: str, tmp_path: Path) -> None:
    overrides, says = mistakes(tmp_path)[name]
    proc = run_cli(overrides, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]


def test_a_mistake_only_the_ranks_find_is_printed_once_and_the_launch_ends_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-corpus.txt"  # the data is opened by the ranks, not by the pre-launch checks
    proc = run_cli(["--nproc", "2", "--training.dataset", "text", "--training.dataset_path", str(missing)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert sum("meshforge train: error:" in line and str(missing) in line for line in lines) == 1, proc.stderr
    assert lines[-1].startswith("meshforge train: rank ") and "exited with code 2" in lines[-1], proc.stderr
    assert len(lines) <= 8, proc.stderr
