"""The second GPU window's verdicts (scripts/gpu_window.py): each check's outcome read against its reference.

* local ranks: losses and gradient norms of each ``lr_*`` run against its one-process reference on the same device
  (``RTOL``); a torch without local tensors makes the run ``unsupported`` (the one line meshforge prints), not failed;
* memory: the last step's ``max_memory_allocated`` / ``max_memory_reserved`` beside the exact step's and the
  planner's peak for the same flags (docs/benchmarks/gpu/memory_expected.json), the differences named;
* Float8 and the bench: from the bench's own results.json, steps 4-8 median tokens/s of each Float8 run over the bf16
  compiled baseline and the first 3 losses against its (``wrong`` past 2 %);
* activation offload: memory and step time against the same run without offload.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_check import Outcome, max_rel, read_metrics

LOCAL_REFERENCE = {"lr_tp2": "lr_dense_ref", "lr_cp2": "lr_dense_ref", "lr_fsdp2": "lr_dense_ref"}
LOCAL_REFERENCE |= {"lr_ep2": "lr_moe_ref"}
RTOL = {"cpu": {"losses": 1e-5, "grad_norms": 1e-6}, "cuda": {"losses": 1e-4, "grad_norms": 1e-4}}
"""CPU: scripts/local_ranks_check.py's tolerance (tests/parity.py). CUDA: gpu_check.py's for FSDP / TP / EP against
one process (1e-4; the first window measured 6e-8 to 1.2e-7): sharded CUDA matmuls reduce in another order."""
NO_LOCAL_TENSORS = "needs torch's local tensors"
"""What meshforge prints when this torch lacks torch.distributed._local_tensor (parallel/local_ranks.py)."""
FLOAT8_RUNS = ("compile_float8_tensorwise", "compile_float8_rowwise")
FLOAT8_RTOL = 2e-2
FIRST_LOSSES = 3
DIFFERENCES = (
    "reserved - allocated: the caching allocator's cached, unused blocks; allocated - exact: what the traced step does "
    "not hold (cuBLAS / SDPA workspaces, the allocator's rounding to 512 B blocks, the RNG and autocast caches); the "
    "CUDA context (~0.5 GiB) is in neither, only in nvidia-smi; planner - reserved: the planner's model error"
)


def judge_local(outcomes: dict[str, Outcome], device: str) -> dict[str, Any]:
    verdict: dict[str, Any] = {}
    for name, o in outcomes.items():
        if name.startswith("lr_") and o.status == "failed" and NO_LOCAL_TENSORS in o.tail:
            o.status = "unsupported"
            o.details["why"] = (o.tail.strip().splitlines() or [""])[-1][:300]
    for name, ref_name in LOCAL_REFERENCE.items():
        run, ref = outcomes.get(name), outcomes.get(ref_name)
        if not (run and run.status in ("ok", "wrong")):  # "wrong": judged after an earlier check, judged again
            continue
        if not (ref and ref.status == "ok"):
            run.status, run.tail = "unchecked", f"its reference {ref_name} did not pass: values unchecked"
            continue
        for key, rtol in RTOL[device].items():
            diff = max_rel(run.details.get(key, []), ref.details.get(key, []))
            verdict[f"{name}_{key}_max_rel_diff"] = diff
            if not diff <= rtol:
                run.status, run.tail = (
                    "wrong",
                    f"{key} differ from {ref_name} by {diff:.3g} relative (tolerance {rtol})",
                )
    return verdict


def judge_memory(outcomes: dict[str, Outcome], expected: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for name, o in outcomes.items():
        if not name.startswith("mem_") or o.status != "ok" or "max_memory_allocated_gib" not in o.details:
            continue
        want = expected.get(name, {})
        got = o.details
        row = {k: got[k] for k in ("max_memory_allocated_gib", "max_memory_reserved_gib")}
        row |= {k: want.get(k) for k in ("exact_peak_gib", "planner_peak_gib")}
        if row["exact_peak_gib"] is not None:
            row["allocated_minus_exact_gib"] = round(row["max_memory_allocated_gib"] - row["exact_peak_gib"], 3)
            row["planner_minus_reserved_gib"] = round(row["planner_peak_gib"] - row["max_memory_reserved_gib"], 3)
        row["reserved_minus_allocated_gib"] = round(row["max_memory_reserved_gib"] - row["max_memory_allocated_gib"], 3)
        rows[name] = row
    return {"memory": rows, "memory_differences": DIFFERENCES} if rows else {}


def bench_records(folder: Path) -> dict[str, dict[str, Any]]:
    path = folder / "results.json"
    if not path.is_file():
        return {}
    return {r["name"]: r for r in json.loads(path.read_text()).get("runs", [])}


def judge_bench(outcomes: dict[str, Outcome], folder: Path) -> dict[str, Any]:
    """Float8's speed-up and first losses against the bf16 compiled baseline; each bench run's status."""
    records = bench_records(folder)
    verdict: dict[str, Any] = {"bench_runs": {n: r.get("status") for n, r in records.items()}}
    base = records.get("compile")
    for check, names in (("float8_1b", ("compile", *FLOAT8_RUNS)), ("bench_gpu1", tuple(records))):
        o = outcomes.get(check)
        if o is None or o.status != "ok":
            continue
        bad = [n for n in names if records.get(n, {}).get("status") != "ok"]
        if bad:
            o.status, o.tail = "failed", f"bench runs not ok: {', '.join(bad)} (see {folder / 'results.json'})"
    for name in FLOAT8_RUNS:
        run = records.get(name)
        if not (base and run and base.get("status") == run.get("status") == "ok"):
            continue
        first = [loss for _, loss in run["loss_curve"][:FIRST_LOSSES]]
        ref = [loss for _, loss in base["loss_curve"][:FIRST_LOSSES]]
        diff = max_rel(first, ref)
        verdict[name] = {
            "speedup_over_bf16": round(run["tps_per_device"] / base["tps_per_device"], 3),
            "tps_per_device": run["tps_per_device"],
            "bf16_tps_per_device": base["tps_per_device"],
            "first_losses": first,
            "bf16_first_losses": ref,
            "first_losses_max_rel_diff": diff,
        }
        o = outcomes.get("float8_1b")
        if o and o.status == "ok" and not diff <= FLOAT8_RTOL:
            o.status, o.tail = "wrong", f"{name}: first losses differ from bf16 by {diff:.3g} (tolerance {FLOAT8_RTOL})"
    return verdict


def judge_offload(outcomes: dict[str, Outcome], dumps: dict[str, str]) -> dict[str, Any]:
    on, off = outcomes.get("offload_1b"), outcomes.get("mem_1b_selective")
    if not (on and off and on.status == off.status == "ok"):
        return {}
    m_on, m_off = read_metrics(dumps["offload_1b"]), read_metrics(dumps["mem_1b_selective"])
    return {
        "offload": {
            "reserved_gib": [on.details.get("max_memory_reserved_gib"), off.details.get("max_memory_reserved_gib")],
            "tokens_per_s": [m_on.get("tps"), m_off.get("tps")],
            "note": "[with activation offload, without]; last-step peaks; tokens/s median after step 3",
        }
    }
