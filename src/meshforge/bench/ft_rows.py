"""Bench rows run under fault tolerance: ``fault_tolerance = true`` on a [[run]] with ``dp_replicate = R`` runs HSDP's
replicate dimension as R torchft replica groups of ``ranks / R`` ranks each (train/fault_tolerance.py), started by
one ``meshforge train --nproc N --fault_tolerance.enable --fault_tolerance.local_replicas R`` (a local Lighthouse
plus R torchruns, train/ft_cli.py). The layout flags describe one group (replicate 1 inside it).

Each group writes its own ``replica_<i>/metrics.jsonl``; the row's metrics are the groups' step by step: the loss is
their mean (each group's loss is the mean over its own dp ranks and every group trains the same number of sequences,
so the mean is the global loss plain HSDP logs), tokens/s per device the mean, step time and memory the worst.

The report's "Fault tolerance cost" table sets each such row beside the plain run of the same shape (same ranks and
degrees, no fault tolerance) in the same sweep: the throughput ratio with the bench's interval (bench/stats.py).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from meshforge.bench import stats

Record = dict[str, Any]
WORST = ("step_time_s", "elapsed_s", "peak_memory_gib", "data_loading_pct")
MEAN = ("loss", "tps", "tflops", "mfu_pct")


def command(train_args: list[str], ranks: int) -> list[str]:
    """The one-machine trial's command line: `meshforge train --nproc N ...` (it starts the Lighthouse and groups)."""
    return [sys.executable, "-m", "meshforge", "train", "--nproc", str(ranks), *train_args]


def metrics_files(folder: Path, replicas: int) -> list[Path]:
    return [folder / f"replica_{i}" / "metrics.jsonl" for i in range(replicas)]


def merge(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The groups' records of the steps every group logged, combined (module docstring); [] if a group logged none."""
    by_step = [{m["step"]: m for m in records} for records in groups]
    if not by_step or not all(by_step):
        return []
    common = sorted(set.intersection(*(set(steps) for steps in by_step)))
    out = []
    for step in common:
        rows = [steps[step] for steps in by_step]
        merged = dict(rows[0])
        for key in MEAN:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                merged[key] = statistics.fmean(values)
        for key in WORST:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                merged[key] = max(values)
        merged["replica_groups"] = len(rows)
        out.append(merged)
    return out


def plain_twin(results: dict[str, Any], record: Record) -> Record | None:
    """The run of the same shape without fault tolerance (same ranks, layout, sequence length, batch)."""
    for other in results["runs"]:
        same = all(other.get(k) == record.get(k) for k in ("world_size", "layout", "seq_len", "global_batch_size"))
        if same and not other.get("flags", {}).get("fault_tolerance") and other["status"] == "ok":
            return other
    return None


def cost_lines(results: dict[str, Any]) -> list[str]:
    """The "Fault tolerance cost" section: each fault-tolerant row vs its plain twin ([] when the sweep has none)."""
    rows = [r for r in results["runs"] if r.get("flags", {}).get("fault_tolerance")]
    if not rows:
        return []
    level = float(results["bench"].get("confidence") or stats.CONFIDENCE)
    lines = [
        "\n### Fault tolerance cost (torchft replica groups vs plain HSDP of the same shape)\n",
        f"| Fault-tolerant run | Plain run | TPS/device FT | TPS/device plain | FT / plain ({level:.0%} CI) "
        "| Step time s FT | Step time s plain | Status |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        twin = plain_twin(results, r)
        cell, plain_tps, plain_step = "-", "-", "-"
        if twin is not None:
            plain_tps, plain_step = f"{twin['tps_per_device']:,.1f}", f"{twin['step_time_s']:.3f}"
        if twin is not None and r["status"] == "ok" and r.get("tps_steps") and twin.get("tps_steps"):
            ratio = stats.ratio_ci(r["tps_steps"], twin["tps_steps"], level)
            star = " *" if ratio.excludes(1.0) else ""
            cell = f"{ratio.median:.2f}x ({ratio.low:.2f}-{ratio.high:.2f}){star}"
        ft_tps = "-" if r.get("tps_per_device") is None else f"{r['tps_per_device']:,.1f}"
        ft_step = "-" if r.get("step_time_s") is None else f"{r['step_time_s']:.3f}"
        twin_name = f"`{twin['name']}`" if twin is not None else "none in this sweep"
        lines.append(
            f"| {r['label']} (`{r['name']}`) | {twin_name} | {ft_tps} | {plain_tps} | {cell} | {ft_step} | "
            f"{plain_step} | {r['status']} |"
        )
    lines.append(
        "\nFT / plain < 1 is the price of fault tolerance: the Manager's quorum with the Lighthouse every step, the "
        "replicate all-reduce through torchft's own process group instead of FSDP's, and the commit vote. `*`: the "
        "interval excludes 1."
    )
    return lines
