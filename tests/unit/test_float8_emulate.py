"""``quantize.dense.float8.emulate = auto`` (the default): emulated Float8 matmuls on a CPU, torch._scaled_mm kernels
on CUDA, the banner saying which; true / false (and the bare switch) keep their meaning."""

from __future__ import annotations

import pytest
import torch

from meshforge.config.io import load_config
from meshforge.config.schema import Float8
from meshforge.errors import ConfigError
from meshforge.parallel.float8 import emulated, resolve_emulation

KEY = "--quantize.dense.float8.emulate"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], "auto"),
        ([KEY], True),
        ([KEY, "true"], True),
        ([KEY, "false"], False),
        ([KEY, "auto"], "auto"),
        ([f"{KEY}=off"], False),
        ([KEY, "--training.steps", "3"], True),
    ],
)
def test_cli_values(argv: list[str], want: object) -> None:
    assert load_config(None, argv).quantize.dense.float8.emulate == want


def test_a_wrong_word_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"emulate = 'sometimes' is not allowed"):
        load_config(None, [KEY, "sometimes"])


def test_toml_booleans_still_load(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "job.toml"
    path.write_text("[quantize.dense.float8]\nenable = true\nemulate = false\n")
    assert load_config(str(path)).quantize.dense.float8.emulate is False


@pytest.mark.parametrize(
    ("emulate", "device", "want", "words"),
    [
        ("auto", "cpu", True, "emulated in high precision (auto)"),
        ("auto", "cuda", False, "_scaled_mm kernels (auto)"),
        (False, "cpu", False, "kernels (as configured)"),
        (True, "cuda", True, "emulated in high precision (as configured)"),
    ],
)
def test_resolution(emulate: object, device: str, want: bool, words: str) -> None:
    cfg = Float8(enable=True, emulate=emulate)  # type: ignore[arg-type]
    assert emulated(cfg, device) is want
    resolved, how = resolve_emulation(cfg, torch.device(device))
    assert resolved.emulate is want and how.startswith("Float8 tensorwise") and how.endswith(words)
    assert resolve_emulation(Float8(), torch.device(device)) == (Float8(), "")  # Float8 off: nothing to say


def test_a_cpu_run_is_emulated_by_default_and_the_banner_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import tempfile

    from meshforge.train.loop import train

    argv = [
        "--model.flavor",
        "tiny",
        "--training.steps",
        "1",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
    ]
    argv += ["2", "--quantize.dense.float8.enable", "--training.mixed_precision_param", "float32"]
    argv += ["--model.dim", "64", "--job.dump_folder", tempfile.mkdtemp()]
    records = train(load_config(None, argv))
    banner = next(line for line in capsys.readouterr().out.splitlines() if "compute dtype" in line)
    assert "Float8 tensorwise emulated in high precision (auto)" in banner and len(records) == 1


def test_a_pipeline_stage_without_blocks_converts_nothing_without_error() -> None:
    """The matrix found it: under a V schedule the last stage holds only the norm and the (filtered) output."""
    from meshforge.model.flavors import get_flavor
    from meshforge.model.llama import build_model
    from meshforge.parallel.float8 import apply_float8

    model = build_model(get_flavor("debugmodel").with_seq_len(32))
    model.layers = torch.nn.ModuleDict()  # the blocks live on other stages
    model.tok_embeddings = None  # type: ignore[assignment]
    assert apply_float8(model, Float8(enable=True), fsdp=False) == []
    blocks = build_model(get_flavor("debugmodel").with_seq_len(32))
    with pytest.raises(ConfigError, match="no linear layer qualifies"):  # blocks, every layer filtered: still refused
        apply_float8(blocks, Float8(enable=True, filter_fqns=["layers", "output"]), fsdp=False)
