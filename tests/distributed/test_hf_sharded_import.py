"""Hugging Face import into a sharded layout reads only each rank's slices: under FSDP 2 x TP 2 the imported weights
equal a one-process import exactly, no rank calls ``get_tensor`` for a sharded parameter, and each rank reads about a
quarter of the model (plus whole heads around its wq / wk rows)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from launcher import run_ranks
from parity import BASE

pytestmark = pytest.mark.distributed


class CountingFile:
    """A safetensors handle that counts the elements each read returns."""

    def __init__(self, handle: Any, counts: dict[str, int]) -> None:
        self.handle, self.counts = handle, counts

    def __enter__(self) -> CountingFile:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get_tensor(self, name: str) -> Any:
        tensor = self.handle.get_tensor(name)
        self.counts["get_tensor"] += tensor.numel()
        return tensor

    def get_slice(self, name: str) -> Any:
        counts, inner = self.counts, self.handle.get_slice(name)

        class Slice:
            def get_shape(self) -> list[int]:
                return list(inner.get_shape())

            def __getitem__(self, index: Any) -> Any:
                out = inner[index]
                counts["get_slice"] += out.numel()
                return out

        return Slice()


def import_weights(hf_dir: str, overrides: list[str]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Runs inside a rank: the real start-up with initial_load_path = the HF folder; returns the full weights and
    the elements this rank read."""
    import safetensors
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from meshforge.config.io import load_config
    from meshforge.train.loop import setup

    counts = {"get_tensor": 0, "get_slice": 0}
    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: CountingFile(real(*a, **k), counts)  # type: ignore[assignment]
    try:
        dump = tempfile.mkdtemp()
        args = [*BASE, "--job.dump_folder", dump, "--checkpoint.initial_load_path", hf_dir, *overrides]
        state = setup(load_config(None, args))
    finally:
        safetensors.safe_open = real  # type: ignore[assignment]
    weights = get_model_state_dict(state.model_parts[0], options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().numpy().copy() for k, v in weights.items()}, counts


def test_fsdp2_tp2_import_reads_only_slices_and_equals_one_process() -> None:
    import torch

    from meshforge.checkpoint import hf as hf_interop
    from meshforge.model.flavors import get_flavor
    from meshforge.model.llama import build_model

    args = get_flavor("tiny").with_seq_len(64)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(11)
    hf_dir = Path(tempfile.mkdtemp()) / "hf"
    hf_interop.save_hf({k: v.detach() for k, v in model.state_dict().items()}, args, hf_dir, dtype="float32")
    total = sum(p.numel() for p in model.parameters())

    single, _ = run_ranks(import_weights, 1, str(hf_dir), [])[0]
    want = {k: v.numpy() for k, v in hf_interop.load_hf(hf_dir, args).items()}
    assert all(np.array_equal(single[k], want[k]) for k in want)
    ranks = run_ranks(import_weights, 4, str(hf_dir), ["--parallelism.tensor_parallel_degree", "2"])
    for weights, counts in ranks:
        assert weights.keys() == single.keys()
        assert all(np.array_equal(weights[k], single[k]) for k in single)
        assert counts["get_tensor"] == 0  # every parameter is a DTensor under FSDP: slices only
        assert total / 4 <= counts["get_slice"] <= total * 0.3, (counts, total)
    assert not torch.distributed.is_initialized()
