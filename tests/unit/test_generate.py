"""`meshforge generate`: deterministic for a seed, the same model from a DCP checkpoint and from its HF export,
greedy = argmax, and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.checkpoint import hf, store
from meshforge.cli import main as meshforge_main
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model
from meshforge.tools.generate import load_model, sample


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model's initial weights as a model-only meshforge checkpoint (checkpoint/step-0)."""
    model = build_model(get_flavor("tiny").with_seq_len(64))
    model.to_empty(device="cpu")
    model.init_weights(11)
    folder = tmp_path_factory.mktemp("gen") / "checkpoint"
    meta = {"step": 0, "model_only": True, "dtype": "float32", "world_size": 1, "flavor": "tiny", "layout": "test"}
    store.write_checkpoint({"model": dict(model.state_dict())}, folder, 0, meta, None)
    return folder


def test_sampling_is_deterministic_for_a_seed(checkpoint: Path) -> None:
    model = load_model(checkpoint, None, 64, torch.device("cpu"))
    kwargs = {"max_new_tokens": 12, "temperature": 1.0, "top_k": 0}
    first = sample(model, [0, 5, 6], seed=3, **kwargs)
    assert len(first) == 15 and first[:3] == [0, 5, 6]
    assert sample(model, [0, 5, 6], seed=3, **kwargs) == first
    assert sample(model, [0, 5, 6], seed=4, **kwargs) != first
    greedy = sample(model, [0, 5, 6], max_new_tokens=1, temperature=0, top_k=0, seed=0)
    assert greedy[-1] == int(model(torch.tensor([[0, 5, 6]]))[0, -1].argmax())
    top1 = sample(model, [0, 5, 6], max_new_tokens=4, temperature=1.0, top_k=1, seed=9)
    assert top1 == sample(model, [0, 5, 6], max_new_tokens=4, temperature=0, top_k=0, seed=0)


def test_hf_export_gives_the_same_model(checkpoint: Path, tmp_path: Path) -> None:
    out = hf.checkpoint_to_hf(checkpoint, tmp_path / "hf", None, "float32")
    tokens = torch.tensor([[0, 17, 300, 2]])
    a = load_model(checkpoint, None, 16, torch.device("cpu"))(tokens)
    b = load_model(out, "tiny", 16, torch.device("cpu"))(tokens)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="--flavor"):
        load_model(out, None, 16, torch.device("cpu"))


def test_cli(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "Emma", "--max-new-tokens", "5", "--seed", "1"]
    assert meshforge_main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("Emma") and meshforge_main(argv) == 0 and capsys.readouterr().out == text
    assert meshforge_main(["generate", "--checkpoint", "/nonexistent"]) == 2
    assert "does not exist" in capsys.readouterr().err
