"""Every training config shipped in configs/ passes the dry run (every check a real run makes before step 1,
the composability table included) on CUDA's rules and on CPU's, at the world size it is written for: none is refused
(issue 35: the 70B / 405B configs use TP + compile + full AC, refused on CPU until that combination was fixed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.config.io import load_config
from meshforge.errors import ConfigError
from meshforge.parallel import composability as table
from meshforge.parallel.dims import ParallelDims
from meshforge.tools.dry_run import model_args, plan

REPO = Path(__file__).resolve().parents[2]
WORLD = {"debugmodel": 1, "tiny": 1, "llama3_8b": 8, "llama3_70b": 256, "llama3_405b": 512}
"""Each config's world size (its header comment: the article's GPU counts)."""
CUDA_ONLY = {"llama3_405b": ["--parallelism.enable_async_tensor_parallel", "false"]}
"""Hardware a CPU lacks (async TP needs CUDA symmetric memory): switched off for the CPU-rules run."""


def test_every_shipped_config_is_listed() -> None:
    assert sorted(p.stem for p in (REPO / "configs").glob("*.toml")) == sorted(WORLD)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("name", sorted(WORLD))
def test_shipped_config_passes_the_dry_run_and_the_table(name: str, device: str) -> None:
    path = str(REPO / "configs" / f"{name}.toml")
    overrides = ["--training.device", device, *(CUDA_ONLY.get(name, []) if device == "cpu" else [])]
    cfg = load_config(path, overrides)
    if name in CUDA_ONLY and device == "cpu":  # refused for the hardware only, in one line, not by the table
        with pytest.raises(ConfigError, match="CUDA"):
            plan(load_config(path, ["--training.device", "cpu"]), WORLD[name])
    report = plan(cfg, WORLD[name])
    assert report.target == device
    p = cfg.parallelism
    dims = ParallelDims.from_config(p, WORLD[name])
    rows = table.active_parallelisms(
        p, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep,
        cp_impl=p.context_parallel_impl,
    )  # fmt: skip
    features = table.job_features(cfg, model_args(cfg, []))
    assert table.refusal(rows, features, device) is None, (rows, features)
