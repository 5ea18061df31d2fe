"""The trainer and the planner give the same verdict on a layout, message included (issue 45.2): a seeded draw of
degrees x model shapes (the real flavors and odd ones whose dims / heads / vocab / seq_len do not divide) x pipeline
layouts (degrees, schedules, microbatches, layers per stage, first / last stage less layers, FSDP resharding), each
judged by the checks `meshforge train --dry-run` (and the bench, and training) runs before it builds anything, the
pipeline's stage split included, and by the planner (`meshforge plan`'s layout_from_config + Layout.check). A rule
written in one place only fails this test."""

from __future__ import annotations

import random

import pytest

from meshforge.config.io import load_config
from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.model.hf_config import resolve_model_args
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.layout import Layout
from meshforge.parallel.pipeline.catalog import SCHEDULES
from meshforge.parallel.pipeline.stage import plan_pipeline
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
PIPELINE_DRAWS = 240


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


def draw_pipeline(rng: random.Random) -> tuple[list[str], int]:
    """One pipeline job: a real or odd flavor, pp 2-4 with other degrees, any schedule, microbatching, stage split
    and FSDP resharding policy. AC and compile stay where the composability table (which the planner asks only for
    its own cost model's features) refuses nothing."""
    flavor = rng.choice(("tiny", "debugmodel", "8B", "70B", "405B"))
    degrees = {
        "data_parallel_shard_degree": rng.choice((1, 2)),
        "tensor_parallel_degree": rng.choice((1, 1, 2)),
        "pipeline_parallel_degree": rng.choice((2, 3, 4)),
    }
    world = degrees["data_parallel_shard_degree"] * degrees["tensor_parallel_degree"]
    world *= degrees["pipeline_parallel_degree"]
    pp_keys = {
        "pipeline_parallel_schedule": rng.choice(SCHEDULES),
        "pipeline_parallel_microbatch_size": rng.choice((1, 1, 2, 3)),
        "pipeline_parallel_layers_per_stage": rng.choice((-1, -1, 1, 2, 3, 5)),
        "pipeline_parallel_first_stage_less_layers": rng.choice((0, 1, 1, 2, 4)),
        "pipeline_parallel_last_stage_less_layers": rng.choice((0, 1, 1, 3)),
        "fsdp_reshard_after_forward": rng.choice(("default", "always", "never")),
    }
    batch = rng.choice((1, 2, 4, 6, 8, 12, 16))
    ac = rng.choice((["none"], ["full"], ["selective", "--activation_checkpoint.selective_ac_option", "2"]))
    overrides = ["--model.flavor", flavor, "--training.seq_len", "128", "--training.local_batch_size", str(batch)]
    overrides += ["--activation_checkpoint.mode", *ac]
    for key, value in (degrees | pp_keys).items():
        overrides += [f"--parallelism.{key}", str(value)]
    return overrides, world


def trainer_verdict(cfg: JobConfig, world: int) -> str:
    """What `meshforge train --dry-run` (tools/dry_run.py plan) and the bench check before building anything, and the
    pipeline's plan (stage split, schedule) that training and the dry run build from."""
    try:
        args = resolve_model_args(cfg.model, cfg.training.seq_len)
        Layout.from_config(cfg, world).check(args)
        if cfg.parallelism.pipeline_parallel_degree > 1:
            dims = ParallelDims.from_config(cfg.parallelism, world)
            plan_pipeline(
                cfg.parallelism, cfg.training, dims, args.n_layers, cfg.compile.enable, cfg.activation_checkpoint
            )
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


@pytest.mark.parametrize("seed", [0, 1])
def test_trainer_and_planner_agree_on_every_drawn_pipeline_layout(seed: int) -> None:
    rng = random.Random(seed)
    verdicts: set[str] = set()
    for _ in range(PIPELINE_DRAWS // 2):
        overrides, world = draw_pipeline(rng)
        cfg = load_config(None, overrides)
        trainer, planner = trainer_verdict(cfg, world), planner_verdict(cfg, world)
        assert trainer == planner, (overrides, world)
        verdicts.add(trainer.split(" = ")[0].split(" (")[0].split(" needs")[0])
    assert "valid" in verdicts and len(verdicts) >= 5, verdicts  # the draw reaches both sides of several rules
