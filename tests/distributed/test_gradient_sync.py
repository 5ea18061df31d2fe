"""One gradient exchange per optimizer step under gradient accumulation ([gradient_sync], parallel/gradient_sync.py):
counted with meshforge's collective counter over the real train_step. FSDP 2 and HSDP 2 x 2 at
gradient_accumulation_steps 4 reduce-scatter and all-reduce exactly the calls and bytes of GA 1 at every step, where
the per-micro-step exchange moves 4 x the reduce-scatter bytes; the losses and gradient norms equal the
per-micro-step exchange's to 1e-6 (fp32). Pipeline parallel 2 x FSDP 2 at GA 2 too. The default mode auto decides by
memory after the first step (train/grad_accum.py): that step exchanges every micro-step, the later ones once (the
host's memory holds the debug model's unsharded gradients); under the pipeline once from the first step."""

from __future__ import annotations

from typing import Any

import pytest
from collective_run import count_collectives
from launcher import run_ranks

pytestmark = pytest.mark.distributed

HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
GA4 = ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "4"]


STEPS = ["--training.steps", "3"]
"""Step 1 (auto measures memory, so it exchanges every micro-step) and two steps after its decision: what every
assertion here compares; BASE's 5 steps added 2 more of the same (and 40 % of each run's time)."""


def run(world: int, args: list[str]) -> dict[str, Any]:
    return run_ranks(count_collectives, world, [*STEPS, *args])[0]  # type: ignore[no-any-return]


def gradient_exchange(out: dict[str, Any]) -> dict[int, dict[str, list[int]]]:
    """Per step: the reduce-scatters and all-reduces (gradients, grad norm), without the parameter all-gathers and
    the pipeline's per-run loss all-reduce over pp."""
    skip = ("all_gather", "all_reduce@pp")
    return {s: {k: v for k, v in t.items() if not k.startswith(skip)} for s, t in out["steps"].items()}


def assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    for g, w in zip(got["records"], want["records"], strict=True):
        assert abs(g["loss"] - w["loss"]) <= 1e-6 * abs(w["loss"]), (g["step"], g["loss"], w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-6 * abs(w["grad_norm"]), (g["step"], g, w)


PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
GA2 = ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2"]
LAYOUTS = {"fsdp 2": (2, [], GA4, 4), "hsdp 2x2": (4, HSDP, GA4, 4), "pp 2 x fsdp 2": (4, PP, GA2, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulation_exchanges_gradients_once_per_step(layout: str) -> None:
    """Pipeline parallel: torch's schedule reduces once per run; the runs before the last skip it."""
    world, extra, accumulate, k = LAYOUTS[layout]
    ga1 = run(world, ["--training.local_batch_size", "4", *extra])
    once = run(world, [*accumulate, *extra])  # gradient_sync.mode = auto: decided by memory after the first step
    every = run(world, [*accumulate, *extra, "--gradient_sync.mode", "every_microstep"])
    got, want = gradient_exchange(once), gradient_exchange(ga1)
    if not extra or extra == HSDP:  # no pipeline: the measured first step exchanges every micro-step
        assert got.pop(1) == gradient_exchange(every)[1], "auto's first step is not FSDP's every micro-step exchange"
        want.pop(1)
    assert got == want, (got, want)
    for step, table in every["steps"].items():  # FSDP's default: every micro-step reduce-scatters
        calls, nbytes = table["reduce_scatter@dp_shard"]
        assert [calls, nbytes] == [k * x for x in ga1["steps"][step]["reduce_scatter@dp_shard"]], table
        if layout == "hsdp 2x2":
            assert table["all_reduce@dp_replicate"][1] == 4 * ga1["steps"][step]["all_reduce@dp_replicate"][1]
    assert_same_training(once, every)


def test_keeping_parameters_gathered_saves_the_regathers_and_trains_the_same() -> None:
    once = [*GA4, "--gradient_sync.mode", "once_per_step"]
    reshard = run(2, once)
    keep = run(2, [*once, "--gradient_sync.regather", "keep"])
    for step, table in keep["steps"].items():
        calls, _ = table["all_gather@dp_shard"]
        assert calls < reshard["steps"][step]["all_gather@dp_shard"][0], (table, reshard["steps"][step])
    assert gradient_exchange(keep) == gradient_exchange(reshard)
    assert_same_training(keep, reshard)
