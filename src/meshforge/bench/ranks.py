"""How many ranks a fair comparison uses on this machine, and which runs have more ranks than the machine has cores.

Strategies are ranked on speed only where every rank has a core (CPU) or a GPU of its own: with more ranks than
cores the ranks time-slice the cores, and per-rank throughput measures the scheduler as much as the strategy. The
*ranked rank count* is the largest power of two that the usable cores (``os.sched_getaffinity``) or the local GPUs
allow, at least 2 (a comparison needs a collective), at most the matrix's ``max_ranked_ranks``. A run of the matrix
with ``ranks = 0`` runs at that count, and one axis set to -1 (``tp = -1``, ``pp = -1``, ``cp = -1``, or
``dp_shard = -1``) takes what the other axes leave: ``ranks = 0, tp = -1`` is TP 2 on 2 cores and TP 4 on 4.
Compositions that need more ranks than that (2D, 3D) keep their fixed ``ranks``; on a CPU with fewer cores they are
*oversubscribed*: they still prove loss parity and memory, and the report does not rank them on speed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshforge.errors import ConfigError

AXES = ("tp", "pp", "cp")


def power_of_two_floor(n: int) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 << (max(1, n).bit_length() - 1)


def ranked_ranks(device: str, cores: int, gpus: int, cap: int = 0) -> int:
    """Ranks per strategy for the ranked comparison: one per core (CPU) or per GPU (CUDA), a power of two (the
    degrees must divide heads, layers and the global batch), at least 2, at most ``cap`` when ``cap`` > 0."""
    slots = gpus if device == "cuda" else cores
    n = power_of_two_floor(slots)
    if cap > 0:
        n = min(n, power_of_two_floor(cap))
    return max(2, n)


def detect(device: str) -> tuple[int, int]:
    """(usable CPU cores, local GPUs) of this process."""
    from meshforge.bench.machine import cpu_cores

    gpus = 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    return cpu_cores(), gpus


def resolve_run(run: Any, ranks: int, where: str) -> Any:
    """``run`` (a BenchRun) with ``ranks = 0`` set to ``ranks`` and its one -1 axis (tp, pp or cp) set to what the
    other degrees leave; a run with fixed degrees comes back unchanged."""
    if run.ranks == 0:
        run = replace(run, ranks=ranks)
    free = [axis for axis in AXES if getattr(run, axis) == -1]
    if not free:
        return run
    if len(free) > 1:
        raise ConfigError(f"{where}: {' and '.join(free)} are both -1; set at most one axis to -1 (it takes the rest)")
    dp_shard = 1 if run.dp_shard == -1 else run.dp_shard
    others = run.dp_replicate * dp_shard * run.tp * run.pp * run.cp * -1  # the free axis counted as 1
    if others < 1 or run.ranks % others:
        raise ConfigError(f"{where}: {run.ranks} ranks cannot hold the fixed degrees ({others}) with {free[0]} = -1")
    return replace(run, dp_shard=dp_shard, **{free[0]: run.ranks // others})


def oversubscribed(ranks: int, cores: int) -> bool:
    """More ranks than CPU cores (``cores`` 0: GPUs, never oversubscribed, one rank per GPU or the run is refused)."""
    return cores > 0 and ranks > cores


def resolve_ranks(head: dict[str, Any], runs: list[Any], device: str) -> tuple[dict[str, Any], list[Any]]:
    """The [bench] table with ``cores`` and ``ranked_ranks`` filled in (detected unless the matrix pins them), and
    the runs with ``ranks = 0`` / a -1 axis resolved to that count."""
    for key in ("cores", "ranked_ranks", "max_ranked_ranks"):
        value = head.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"bench.{key} = {value!r}: use a whole number >= 0 (0: detected)")
    cores, gpus = detect(device)
    head = dict(head)
    head["cores"] = head.get("cores") or (cores if device == "cpu" else 0)
    slots = head["cores"] if device == "cpu" else gpus
    head["ranked_ranks"] = head.get("ranked_ranks") or ranked_ranks(
        device, slots, slots, head.get("max_ranked_ranks", 0)
    )
    return head, [resolve_run(run, head["ranked_ranks"], f"run {run.name!r}") for run in runs]
