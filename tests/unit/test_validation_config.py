"""The [validation] section: its loader reads the val split in order, another dataset can be named, and a batch the
pipeline schedule cannot run is refused."""

from __future__ import annotations

import pytest

from meshforge.config.io import ConfigError, load_config
from meshforge.data.tokenizer import build_tokenizer
from meshforge.parallel.dims import ParallelDims
from meshforge.train.validate import build_validation_loader, should_validate


def test_validation_loader_and_schedule() -> None:
    cfg = load_config(None, ["--validation.enable", "--validation.freq", "4", "--training.steps", "10"])
    fingerprint = build_tokenizer(cfg.model.tokenizer_path).fingerprint
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    loader = build_validation_loader(cfg, dims, 0, fingerprint)
    assert loader is not None and not loader.shuffle and loader.streams[0].split == "val"  # type: ignore[attr-defined]
    first = loader.next_batch()[0]
    loader.reset()
    assert (loader.next_batch()[0] == first).all()  # every evaluation sees the same batches
    assert [s for s in range(1, 11) if should_validate(s, cfg)] == [4, 8, 10]
    off = load_config(None, [])
    assert build_validation_loader(off, dims, 0, fingerprint) is None


def test_pipeline_needs_the_training_batch() -> None:
    cfg = load_config(
        None,
        ["--validation.enable", "--validation.local_batch_size", "3", "--parallelism.pipeline_parallel_degree", "2"],
    )
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    with pytest.raises(ConfigError, match=r"validation\.local_batch_size"):
        build_validation_loader(cfg, dims, 0, "")
    with pytest.raises(ConfigError, match=r"validation\.freq"):
        load_config(None, ["--validation.freq", "0"])
