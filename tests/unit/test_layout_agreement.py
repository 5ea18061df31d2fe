"""The trainer and the planner give the same verdict on a layout, message included (issue 45.2): a seeded draw of
degrees x model shapes (the real flavors and odd ones whose dims / heads / vocab / seq_len do not divide), each judged
by the check `meshforge train --dry-run` (and the bench, and training) runs before it builds anything, and by the
planner (`meshforge plan`'s layout_from_config + Layout.check). A rule written in one place only fails this test."""

from __future__ import annotations

import random

import pytest

from meshforge.config.io import load_config
from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.model.hf_config import resolve_model_args
from meshforge.parallel.layout import Layout
from meshforge.plan.layout import layout_args, layout_from_config

FLAVORS = ("tiny", "debugmodel", "100m", "1B", "8B", "70B", "405B", "debugmoe_dense")
ODD_SHAPES = (  # --model.* overrides on top of the flavor: shapes no degree-2/3/4 layout divides cleanly
    {"dim": 96, "n_heads": 6, "n_kv_heads": 3},
    {"dim": 120, "n_heads": 5, "n_kv_heads": 5, "ffn_dim": 330},
    {"vocab_size": 2051},
    {"n_heads": 12, "n_kv_heads": 6, "dim": 144, "ffn_dim": 400},
    {"tie_embeddings": "true"},
    {},
)
DRAWS = 160


def draw(rng: random.Random) -> tuple[list[str], int]:
    """One job: config overrides and its world size (the product of the degrees, so neither side refuses it for
    the world size alone)."""
    flavor = rng.choice(FLAVORS)
    shape = rng.choice(ODD_SHAPES) if flavor in ("tiny", "debugmodel") else rng.choice(({}, {"vocab_size": 128257}))
    degrees = {
        "data_parallel_replicate_degree": rng.choice((1, 1, 2)),
        "data_parallel_shard_degree": rng.choice((1, 2, 4)),
        "context_parallel_degree": rng.choice((1, 1, 2, 3)),
        "tensor_parallel_degree": rng.choice((1, 2, 3, 4, 8)),
        "pipeline_parallel_degree": rng.choice((1, 1, 2)),
    }
    world = 1
    for value in degrees.values():
        world *= value
    seq_len = rng.choice((64, 96, 100, 128, 2050, 8192))
    overrides = ["--model.flavor", flavor, "--training.seq_len", str(seq_len), "--training.local_batch_size", "8"]
    overrides += ["--activation_checkpoint.mode", "none"]  # the composability table is not what this test draws
    for key, value in shape.items():
        overrides += [f"--model.{key}", str(value)]
    for key, value in degrees.items():
        overrides += [f"--parallelism.{key}", str(value)]
    if rng.random() < 0.2:
        overrides += ["--training.enable_cpu_offload", "true"]
    return overrides, world


def trainer_verdict(cfg: JobConfig, world: int) -> str:
    """What `meshforge train --dry-run` (tools/dry_run.py plan) and the bench check before building anything."""
    try:
        Layout.from_config(cfg, world).check(resolve_model_args(cfg.model, cfg.training.seq_len))
    except ConfigError as exc:
        return str(exc)
    return "valid"


def planner_verdict(cfg: JobConfig, world: int) -> str:
    """What `meshforge plan` checks (estimate.py / the search: layout_from_config, then Layout.check)."""
    try:
        layout = layout_from_config(cfg, world)
        layout.check(layout_args(layout))
    except ConfigError as exc:
        return str(exc)
    return "valid"


@pytest.mark.parametrize("seed", [0, 1])
def test_trainer_and_planner_agree_on_every_drawn_layout(seed: int) -> None:
    rng = random.Random(seed)
    verdicts: set[str] = set()
    for _ in range(DRAWS // 2):
        overrides, world = draw(rng)
        cfg = load_config(None, overrides)
        trainer, planner = trainer_verdict(cfg, world), planner_verdict(cfg, world)
        assert trainer == planner, (overrides, world)
        verdicts.add(trainer.split(" = ")[0].split(" (")[0])
    assert "valid" in verdicts and len(verdicts) >= 4, verdicts  # the draw reaches both sides of several rules
