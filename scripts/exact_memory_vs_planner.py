"""The planner's hardware-free memory terms beside the exact fake-tensor peak (tools/memory_run.py) for the published
8B FSDP 8 and 70B FSDP 32 x TP 8 rows (docs/planner.md, "Exact memory"). Usage:

    PYTHONPATH=src python scripts/exact_memory_vs_planner.py

The planner's figure here is plan/memory.py's ``rank_allocated`` (parameters + gradients + optimizer states at
STATE_BYTES, activations, communication buffers): what a device allocates, before the fitted allocator slack and
framework overhead; the exact figure is the tracked tensor peak of the same config run eager in bf16."""

from __future__ import annotations

import json

from meshforge.config.io import load_config
from meshforge.model.hf_config import resolve_model_args
from meshforge.plan.layout import layout_from_config
from meshforge.plan.memory import STATE_BYTES, rank_allocated
from meshforge.plan.published import run as published_run
from meshforge.tools.memory_cli import exact_memory

GIB = 2**30
ROWS = ("table1.fsdp", "table2.2d")


def compare(key: str) -> dict[str, object]:
    row = published_run(key)
    cfg = load_config(None, list(row.overrides))
    _, exact = exact_memory(cfg, row.world_size)
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    numel, activations, buffers = rank_allocated(args, layout_from_config(cfg, row.world_size), 0)
    states = numel * sum(STATE_BYTES.values())
    by = exact.by_category
    exact_states = sum(by.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    exact_act = sum(v for k, v in by.items() if k.startswith("activations") or k == "temporaries")
    exact_buf = sum(
        by.get(k, 0) for k in ("parameters_unsharded", "gradients_unsharded", "all_gather", "reduce_scatter")
    )
    return {
        "row": key,
        "published_peak_gib": row.memory_gib,
        "exact_peak_gib": round(exact.peak_bytes / GIB, 2),
        "planner_allocated_gib": round((states + activations + buffers) / GIB, 2),
        "states_gib (planner, exact at peak)": (round(states / GIB, 2), round(exact_states / GIB, 2)),
        "activations_gib (planner, exact incl. temporaries)": (round(activations / GIB, 2), round(exact_act / GIB, 2)),
        "buffers_gib (planner, exact)": (round(buffers / GIB, 2), round(exact_buf / GIB, 2)),
        "exact_notes": exact.notes,
    }


if __name__ == "__main__":
    for key in ROWS:
        print(json.dumps(compare(key)))
