"""The pipeline's rule set: whether a layout's schedule, microbatches and stage split can run, each rule written once.

``check_pipeline`` is what ``Layout.check`` (parallel/layout.py) asks for a layout with pp > 1, so training, the dry
run, the bench and the planner give the same verdict with the same one-line ConfigError; training's pipeline build
(pipeline/stage.py ``plan_pipeline``, which also reads CSV schedules) calls the same rules. The stage rules themselves
(stages per rank, the even split, explicit module lists) are pipeline/split.py's. Pure Python (no torch).
"""

from __future__ import annotations

import functools

from meshforge.errors import ConfigError
from meshforge.parallel.pipeline import split
from meshforge.parallel.pipeline.catalog import SCHEDULE_STYLES, SCHEDULES, canonical_schedule


@functools.lru_cache(maxsize=4096)
def check_pipeline(
    n_layers: int,
    *,
    pp: int,
    schedule: str,
    local_batch_size: int,
    microbatch_size: int,
    layers_per_stage: int = -1,
    first_less: int = 1,
    last_less: int = 1,
    stage_modules: tuple[tuple[str, ...], ...] = (),
    resharding: bool = False,
) -> None:
    """ConfigError naming the first reason a pipeline of ``pp`` ranks cannot run ``n_layers`` blocks: the schedule,
    the microbatches, the stage split (``layers_per_stage``, ``first_less`` / ``last_less`` blocks fewer on the
    first / last stage, or explicit ``stage_modules``), then whether a split backward meets FSDP ``resharding`` after
    forward. parallel/layout.py ``Layout.check`` passes its fields (a CSV schedule is checked where it is read:
    pipeline/schedule.py ``read_csv_schedule``). Memoised (the search checks thousands of layouts; a refusal is raised
    again each time, never cached)."""
    name = resolve_schedule_name(schedule)
    style, split_backward = SCHEDULE_STYLES[name]
    n_micro = num_microbatches(local_batch_size, microbatch_size)
    kw = {"first_less": first_less, "last_less": last_less}
    explicit = len(stage_modules)
    num_stages = split.count_stages(n_layers, pp, style, explicit=explicit, layers_per_stage=layers_per_stage, **kw)
    split.split_stages(n_layers, num_stages, explicit=stage_modules, **kw)
    check_microbatches(name, n_micro, pp, num_stages)
    check_split_backward(name, split_backward, resharding=resharding)


def resolve_schedule_name(name: str) -> str:
    """Canonical schedule name; case-insensitive, accepts torch class names (Schedule1F1B) and interleave_1f1b."""
    canonical = canonical_schedule(name)
    if canonical is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is unknown; choose one of {', '.join(SCHEDULES)} "
            "(case-insensitive; interleave_1f1b and torch class names such as ScheduleGPipe work too)"
        )
    return canonical


def num_microbatches(local_batch_size: int, microbatch_size: int) -> int:
    """Microbatches per step; the local batch must divide evenly."""
    if local_batch_size % microbatch_size:
        raise ConfigError(
            f"training.local_batch_size = {local_batch_size} is not divisible by "
            f"parallelism.pipeline_parallel_microbatch_size = {microbatch_size}; make the batch a multiple of it"
        )
    return local_batch_size // microbatch_size


def check_microbatches(schedule: str, n_microbatches: int, pp: int, num_stages: int) -> None:
    """torch's rules for each named schedule, raised as a config error before any process waits on another."""
    fix = "raise training.local_batch_size or lower parallelism.pipeline_parallel_microbatch_size"
    have = f"{n_microbatches} microbatches (local batch / microbatch size)"
    if schedule in ("1F1B", "DualPipeV") and n_microbatches < num_stages:
        raise ConfigError(
            f"pipeline schedule {schedule} needs at least {num_stages} microbatches (one per stage) "
            f"but has {have}; {fix}"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ConfigError(
                f"pipeline schedule {schedule} needs the microbatch count to be a multiple of its rounds "
                f"max(1, microbatches // pp) = {rounds} but has {have}; use a multiple of pp = {pp}"
            )


def check_split_backward(schedule: str, split_backward: bool, *, resharding: bool) -> None:
    """A schedule that splits the backward into input and weight gradients loses the weights FSDP resharded after
    forward: refused instead of training silently wrong. ``resharding``: FSDP shards and reshards after forward."""
    if split_backward and resharding:
        # torch's split backward (stage_backward_input) finds the weights to differentiate from
        # `stage.submod.parameters()` when the I action runs. With reshard-after-forward, FSDP2 has swapped the
        # sharded DTensor parameters back onto the modules after forward, and those are not the unsharded tensors
        # the forward graph used: no gradient path is found, the W action computes nothing for them, and their
        # gradients stay None (see docs/pipeline.md, "FSDP resharding and zero-bubble schedules").
        raise ConfigError(
            f"parallelism.fsdp_reshard_after_forward = 'always' with the {schedule} schedule gives wrong gradients "
            "(its split input/weight backward loses the weights FSDP resharded); use 'default' or 'never'"
        )


def check_csv_split_backward(
    schedule: str, split_backward: bool, *, compile_enabled: bool, ac_mode: str, ac_option: str
) -> None:
    """Compile and per-op selective AC cannot run a split backward. For the named schedules these are the composability
    table's refused cells (parallel/composability.py, pp_<schedule> x compile / AC per-op selective), which training
    and the planner ask; a CSV schedule's split comes from its file, which the table does not read, so training's
    pipeline build (pipeline/stage.py plan_pipeline) asks this for a CSV schedule."""
    if not split_backward:
        return
    if compile_enabled:
        raise ConfigError(
            f"compile.enable = true with the {schedule} schedule: torch cannot split the backward of compiled "
            "blocks into input and weight gradients; disable compile or use 1F1B / Interleaved1F1B"
        )
    if ac_mode == "selective" and ac_option == "op":
        # Per-op selective AC's cache of saved op outputs is consumed by the input-gradient pass, so the
        # weight-gradient pass of the same region fails ("Trying to backward an extra time"). Full AC and every-N-th
        # block AC recompute the region each time and give the same gradients as no AC.
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = 'op' (the default) does not work with the {schedule} "
            "schedule's split input/weight backward; set activation_checkpoint.mode = 'full' or 'none', or "
            "selective_ac_option = N (every N-th block)"
        )
