"""Bench rows with ``auto = true``: the planner picks the row's layout, as ``meshforge train --parallelism.auto`` does.

A ``[[run]]`` with ``auto = true`` gives a name and ``ranks`` (0: the ranked count) and no layout (no degree, schedule,
compile, Float8, async TP or AC mode: bench/auto_keys.py refuses them in one line); its global batch must be a multiple
of its ranks (the search starts from FSDP over all of them and keeps the global batch). Before the sweep, each is
resolved with plan/guide/auto.py's ``pick`` (the search for that world size on the bench's profile, then fastest first
until the exact fake-tensor memory run admits one) on the row's own job (the matrix's model, sequence, global batch,
dtype and overrides), and becomes an ordinary row with the picked degrees and features, labelled ``auto -> <layout>``.
The profile: ``--hardware`` (a preset, a shipped stack or a stack profile file), else ``cpu`` on a CPU and ``h100`` on
CUDA, as for train. The pick, its runner-up and why go to the row's ``auto`` entry in results.json and to report.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshforge.bench.matrix import local_device, validate_run
from meshforge.bench.spec import BenchMatrix, BenchRun
from meshforge.errors import ConfigError


def profile_name(hardware: str, device: str) -> str:
    """The planner profile of the pick: ``--hardware`` unless empty or 'none', else cpu on a CPU and h100 on CUDA."""
    return hardware if hardware not in ("", "none") else ("cpu" if device == "cpu" else "h100")


def resolve_auto_rows(
    matrix: BenchMatrix, hardware: str = "", device: str = ""
) -> tuple[BenchMatrix, dict[str, dict[str, Any]]]:
    """``matrix`` with every auto row replaced by the row of its pick, and the picks by run name (for results.json)."""
    if not any(run.auto for run in matrix.runs):
        return matrix, {}
    from meshforge.plan.accuracy import stack

    hw = stack.load_profile(profile_name(hardware, device or local_device()))
    runs, picks = [], {}
    for run in matrix.runs:
        if run.auto:
            run, picks[run.name] = resolve_row(matrix, run, hw)
            validate_run(matrix, run)
        runs.append(run)
    return replace(matrix, runs=runs), picks


def resolve_row(matrix: BenchMatrix, run: BenchRun, hw: Any) -> tuple[BenchRun, dict[str, Any]]:
    """One auto row -> the row of plan/guide/auto.py's pick for its world size on ``hw``, and what results.json records
    of the pick."""
    from meshforge.plan.guide import auto

    config, overrides = matrix.config_and_overrides(run)
    try:
        p = auto.pick(overrides, config, run.ranks, hw)
    except ConfigError as exc:
        raise ConfigError(f"run {run.name!r} (auto, {run.ranks} ranks): {exc}") from None
    picked = row_of(run, p.chosen.layout)
    if matrix.local_batch_size(picked) != p.chosen.layout.local_batch_size:
        raise ConfigError(
            f"run {run.name!r}: the pick's local batch {p.chosen.layout.local_batch_size} is not the bench's "
            f"{matrix.local_batch_size(picked)} for global batch {matrix.global_batch_of(run)}; give a global batch "
            "the pick's data-parallel degree divides"
        )
    ac = f", AC {picked.ac_mode}" if picked.ac_mode != matrix.ac_mode else ""
    picked = replace(picked, label=f"auto -> {picked.describe()}{ac}")
    runner = p.runner_up
    record = {
        "hardware": hw.name + (f" (stack {hw.stack.name})" if hw.stack else ""),
        "picked": p.chosen.layout.describe(),
        "predicted_tps_per_device": p.chosen.tps_per_device,
        "runner_up": runner.layout.describe() if runner else None,
        "runner_up_tps_per_device": runner.tps_per_device if runner else None,
        "exact_peak_gib": p.exact_gib,
        "usable_gib": p.usable_gib,
        "refused": [list(r) for r in p.refused],
        "why": auto.explain(p, run.ranks, hw),
    }
    return picked, record


AS_FIELDS = {
    "training.seq_len",
    "training.local_batch_size",
    "activation_checkpoint.mode",
    "compile.enable",
    "quantize.dense.float8.enable",
    "parallelism.enable_async_tensor_parallel",
    "parallelism.pipeline_parallel_schedule",
    *(f"parallelism.{k}_degree" for k in ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")),
    *(f"parallelism.{k}_degree" for k in ("pipeline_parallel", "context_parallel")),
}
"""The training flags a bench row holds as its own fields (the rest of the layout's flags go to its overrides)."""


def layout_keys(layout: Any) -> dict[str, Any]:
    """The planner's training flags for ``layout`` (parallel/layout.py ``Layout.to_train_flags``, the one mapping from
    a layout to `meshforge train`) that a row keeps as overrides: expert degree, microbatch, SAC option, CP impl, the
    memory levers. A flag without a value is True."""
    flags, keys, i = layout.to_train_flags(), {}, 0
    while i < len(flags):
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        keys[flags[i][2:]] = flags[i + 1] if has_value else True
        i += 2 if has_value else 1
    return {k: v for k, v in keys.items() if k not in AS_FIELDS}


def row_of(run: BenchRun, layout: Any) -> BenchRun:
    """``run`` with the degrees, schedule, features and memory levers of the planner's ``layout`` (plan/layout.py)."""
    keys = layout_keys(layout)
    return replace(
        run,
        auto=False,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        schedule=layout.schedule if layout.pp > 1 else run.schedule,
        compile=layout.compile,
        float8=layout.float8,
        async_tp=layout.async_tp,
        ac_mode=layout.ac_mode,
        overrides={**run.overrides, **keys},
    )


def report_lines(results: dict[str, Any]) -> list[str]:
    """report.md: each auto row's pick beside the fastest measured run at its rank count, with the runner-up."""
    records = results["runs"]
    lines: list[str] = []
    for rec in (r for r in records if r.get("auto")):
        a = rec["auto"]
        peers = [r for r in records if r["world_size"] == rec["world_size"] and r.get("tps_per_device")]
        best = max(peers, key=lambda r: r["tps_per_device"], default=None)
        measured = f"{rec['tps_per_device']:,.1f}" if rec.get("tps_per_device") else rec["status"]
        lines.append(
            f"- `{rec['name']}` (auto on {a['hardware']}): picked {a['picked']}: predicted "
            f"{a['predicted_tps_per_device']:,.1f}, measured {measured} tokens/s per device"
            + (
                f"; runner-up {a['runner_up']} (predicted {a['runner_up_tps_per_device']:,.1f})"
                if a["runner_up"]
                else ""
            )
            + (
                f"; fastest measured at {rec['world_size']} ranks: {best['label']}, {best['tps_per_device']:,.1f}"
                if best
                else ""
            )
            + "."
        )
    return ["", "### Auto rows (the planner's pick, as `train --parallelism.auto`)", "", *lines] if lines else []
