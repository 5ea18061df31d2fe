"""A stock PyTorch container (the H200 image of issue 21) has neither ``tomli_w`` nor ``torchao``: meshforge's entry
points import, plan, dry-run and train without them, and a feature that needs one says so in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HIDE = "import sys; sys.modules['tomli_w'] = None; sys.modules['torchao'] = None\n"
"""``sys.modules[name] = None`` makes ``import name`` raise ImportError, as where the package is not installed."""


def run_hidden(code: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDE + code], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def meshforge(*argv: str) -> str:
    return f"from meshforge.cli import main; sys.exit(main({list(argv)!r}))"


def test_entry_modules_import_and_plan_without_tomli_w_and_torchao() -> None:
    entries = ["meshforge.cli", "meshforge.train.cli", "meshforge.train.loop", "meshforge.plan.cli"]
    entries += ["meshforge.bench.cli", "meshforge.tools.dry_run", "meshforge.parallel.parallelize"]
    code = "import importlib\nfor m in " + repr(entries) + ": importlib.import_module(m)\n"
    code += "assert sys.modules['torchao'] is None and sys.modules['tomli_w'] is None\n"
    code += meshforge("plan", "--hardware", "h200", "--world-size", "8", "--model.flavor", "8B")
    proc = run_hidden(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GiB" in proc.stdout, proc.stdout[-2000:]


def test_dry_run_and_train_without_tomli_w_and_torchao(tmp_path: Path) -> None:
    dry = run_hidden(meshforge("train", "--dry-run", "--world-size", "4", "--parallelism.tensor_parallel_degree", "2"))
    assert dry.returncode == 0, dry.stderr[-2000:]
    steps = ["--config", "configs/tiny.toml", "--training.steps", "2", "--job.dump_folder", str(tmp_path)]
    train = run_hidden(meshforge("train", *steps, "--training.local_batch_size", "2", "--training.seq_len", "64"))
    assert train.returncode == 0, train.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 1
    assert (tmp_path / "config.json").is_file() and not (tmp_path / "config.toml").exists()
    assert "instead of config.toml" in train.stderr and "pip install tomli_w" in train.stderr


def test_a_feature_that_needs_the_missing_package_says_so_in_one_line() -> None:
    float8 = run_hidden(meshforge("train", "--dry-run", "--world-size", "1", "--quantize.dense.float8.enable", "true"))
    assert float8.returncode == 2, float8.stderr[-2000:]
    assert float8.stderr.strip().count("\n") == 0 and "Traceback" not in float8.stderr
    assert "Float8" in float8.stderr and "pip install torchao==0.18.0" in float8.stderr
    config = run_hidden(meshforge("config", "show"))
    assert config.returncode == 2 and "pip install tomli_w" in config.stderr and "Traceback" not in config.stderr


def test_torchao_table_names_a_release_for_every_supported_torch() -> None:
    from meshforge.parallel.float8 import torchao_install

    assert torchao_install("2.11.0+cu130") == "pip install torchao==0.18.0"
    assert torchao_install("2.14.1") == "pip install torchao==0.18.0"
    assert torchao_install("2.99.0") == "pip install torchao==0.18.0"  # newer than the table: the newest row
