"""compare-losses: identical runs pass, different runs fail, unreadable input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.cli import main as meshforge
from meshforge.config.io import load_config
from meshforge.tools.compare_losses import align, differences, read_series

TINY = [
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "3",
    "--metrics.log_freq",
    "1",
    "--activation_checkpoint.mode",
    "none",
    "--training.mixed_precision_param",
    "float32",
]


def write_run(folder: Path, losses: dict[int, float]) -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": v, "grad_norm": 1.0}) for s, v in losses.items()]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three single-process runs: two identical, one with another learning rate."""
    from meshforge.train.loop import train

    root = tmp_path_factory.mktemp("runs")
    runs = {"a": [], "same": [], "other_lr": ["--optimizer.lr", "1e-3"]}
    for name, extra in runs.items():
        train(load_config(None, [*TINY, "--job.dump_folder", str(root / name), *extra]))
    return {name: root / name for name in runs}


def test_identical_real_runs_pass_assert_equal(real_runs: dict[str, Path], tmp_path: Path, capsys) -> None:
    png = tmp_path / "curves.png"
    code = meshforge(
        ["compare-losses", str(real_runs["a"]), str(real_runs["same"]), "--assert-equal", "--plot", str(png)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: all 3 steps are bitwise equal" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_different_real_runs_fail(real_runs: dict[str, Path], capsys) -> None:
    a, other = str(real_runs["a"]), str(real_runs["other_lr"])
    assert meshforge(["compare-losses", a, other, "--assert-equal", "--plot", ""]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert meshforge(["compare-losses", a, other, "--rtol", "1e-6", "--plot", ""]) == 1
    # a loose tolerance accepts them; without an assertion the table alone exits 0
    assert meshforge(["compare-losses", a, other, "--rtol", "0.5", "--plot", ""]) == 0
    assert meshforge(["compare-losses", a, other, "--plot", ""]) == 0
    table = capsys.readouterr().out
    assert "max abs diff" in table and "step" in table


def test_rtol_is_relative_to_run_b(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {1: 10.0, 2: 5.0})
    b = write_run(tmp_path / "b", {1: 10.0, 2: 5.0001})  # relative to B: 1e-4 / 5.0001 = 2.0e-5
    rows = align(read_series(str(a), "loss"), read_series(str(b), "loss"))
    assert differences(rows, 1e-5) == ["step 2: 5.0 vs 5.0001 (rel diff 2.000e-05)"]
    assert differences(rows, 3e-5) == []
    assert len(differences(rows, None)) == 1


def test_missing_step_fails_assertion(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a", {1: 3.0, 2: 2.0, 3: 1.0})
    b = write_run(tmp_path / "b", {1: 3.0, 2: 2.0})
    assert meshforge(["compare-losses", str(a), str(b), "--assert-equal", "--plot", ""]) == 1
    assert "step 3: only run A logged it" in capsys.readouterr().out


def test_nan_equals_nan_only(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {1: float("nan"), 2: 1.0})
    b = write_run(tmp_path / "b", {1: float("nan"), 2: float("nan")})
    rows = align(read_series(str(a), "loss"), read_series(str(b), "loss"))
    assert [line.split(":")[0] for line in differences(rows, None)] == ["step 2"]


def test_unreadable_input_exits_2(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a", {1: 1.0})
    assert meshforge(["compare-losses", str(a), str(tmp_path / "nowhere"), "--plot", ""]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert meshforge(["compare-losses", str(a), str(tmp_path / "bad.jsonl"), "--plot", ""]) == 2
    assert "not JSON" in capsys.readouterr().err
