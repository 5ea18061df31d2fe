"""Config: defaults, TOML + dotted overrides with the article's spellings, precedence, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.cli import main
from meshforge.config.io import ConfigError, load_config, to_toml


def test_article_spellings_and_bare_switches() -> None:
    cfg = load_config(
        None,
        [
            "--parallelism.data_parallel_shard_degree",
            "8",
            "--compile.enable",
            "--quantize.dense.float8.enable",
            "--training.deterministic",
            "false",
        ],
    )
    assert cfg.parallelism.data_parallel_shard_degree == 8
    assert cfg.compile.enable and cfg.quantize.dense.float8.enable
    assert cfg.training.deterministic is False


def test_precedence_cli_over_toml_over_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nsteps = 7\nseq_len = 64\n")
    cfg = load_config(str(toml), ["--training.steps=9"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (9, 64, 8)


def test_effective_config_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = load_config(None, ["--parallelism.module_fqns_per_model_part", '[["tok_embeddings"], ["output"]]'])
    path = tmp_path / "eff.toml"
    path.write_text(to_toml(cfg))
    assert load_config(str(path)) == cfg


def test_shipped_configs_load() -> None:
    for path in sorted(Path("configs").glob("*.toml")):
        load_config(str(path))


BAD = [
    (["--training.stepz", "3"], "training.stepz"),
    (["--nosuch.key", "1"], "nosuch.key"),
    (["--training.steps", "ten"], "training.steps"),
    (["--training.steps", "0"], "training.steps"),
    (["--training.deterministic", "maybe"], "training.deterministic"),
    (["--training.mixed_precision_param", "fp8"], "mixed_precision_param"),
    (["--model.flavor", "7B"], "model.flavor"),
    (["--optimizer.lr", "-1"], "optimizer.lr"),
    (["--optimizer.beta2", "1.5"], "optimizer.beta2"),
    (["--activation_checkpoint.mode", "partial"], "activation_checkpoint.mode"),
    (["--activation_checkpoint.selective_ac_option", "every"], "selective_ac_option"),
    (["--parallelism.tensor_parallel_degree", "0"], "tensor_parallel_degree"),
    (["--parallelism.data_parallel_shard_degree", "-3"], "data_parallel_shard_degree"),
    (["--checkpoint.keep_latest_k", "1"], "keep_latest_k"),
    (["--training.dataset", "text"], "dataset_path"),
    (["--quantize.dense", "x"], "quantize.dense"),
    (["--training.steps"], "training.steps"),
]


@pytest.mark.parametrize(("args", "named"), BAD)
def test_bad_config_is_one_line_naming_the_key(args: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, args)
    assert main(["config", "show", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err


def test_bad_toml_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    assert main(["config", "show", "--config", str(bad)]) == 2
    assert main(["config", "show", "--config", str(tmp_path / "missing.toml")]) == 2
    typed = tmp_path / "typed.toml"
    typed.write_text('[training]\nsteps = "many"\n')
    assert main(["config", "show", "--config", str(typed)]) == 2
    assert "training.steps" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--nproc", "4", "--parallelism.tensor_parallel_degree", "3"], "world size"),
        (["--nproc", "2", "--parallelism.data_parallel_shard_degree", "4"], "world size"),
        (
            [
                "--nproc",
                "2",
                "--model.flavor",
                "tiny",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--model.flavor",
                "debugmodel",
                "--parallelism.tensor_parallel_degree",
                "32",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            "world",
        ),
    ],
)
def test_bad_layout_fails_before_starting_processes(args: list[str], named: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshforge", "train", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and named in proc.stderr
    assert "Traceback" not in proc.stderr
