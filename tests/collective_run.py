"""Runs inside a rank: train with BASE + overrides, counting each step's collectives (calls and bytes per collective
and mesh axis) over the real ``train_step`` with meshforge's collective counter."""

from __future__ import annotations

import tempfile
from typing import Any

from parity import BASE


def count_collectives(overrides: list[str]) -> dict[str, Any]:
    """{"steps": {step: {"collective@axis": [calls, bytes]}}, "records": the logged records}."""
    from meshforge.config.io import load_config
    from meshforge.device.collective_counter import CollectiveCounter, axis_names
    from meshforge.parallel.dims import FLATTENED
    from meshforge.train import loop

    dump = tempfile.mkdtemp(prefix="meshforge-test-")
    state = loop.setup(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))
    real, steps = loop.train_step, {}
    axes = axis_names(state.mesh, FLATTENED)

    def counted(s: Any) -> Any:
        with CollectiveCounter(axes) as counter:
            out = real(s)
        steps[s.step] = {f"{c}@{a}": list(v) for (c, a), v in counter.table().items()}
        return out

    loop.train_step = counted  # type: ignore[assignment]
    try:
        records = loop.run_job(state)
    finally:
        loop.train_step = real  # type: ignore[assignment]
    return {"steps": steps, "records": records}
