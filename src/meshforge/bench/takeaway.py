"""The report's first lines: what a reader should take away from a sweep, in a few bullets formatted from
results.json: the ranking and what in it is beyond noise, how the measured gains compare with the article's, how the
planner's leave-one-out predictions order the same runs, and which rows are not ranked (more ranks than cores)."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from meshforge.bench import analysis, stats
from meshforge.bench.machine import noise_warnings
from meshforge.bench.reference import article_ratio, figure

Record = dict[str, Any]


def takeaway_lines(results: dict[str, Any]) -> list[str]:
    """'## Takeaway' and its bullets ([] when fewer than two runs can be ranked)."""
    pool = analysis.ranked_pool(results)
    if len(pool) < 2:
        return []
    level = analysis.confidence_of(results)
    places = stats.ranking({r["name"]: r["tps_steps"] for r in pool}, level)
    noise = noise_warnings(results["machine"], results.get("sweep", {}), results["runs"])
    caution = [f"- **Read with care**: {len(noise)} noise warning(s) below ({noise[0]})."] if noise else []
    return [
        "## Takeaway",
        "",
        *caution,
        ranking_bullet(results, pool, places, level),
        precision_bullet(results, pool),
        *article_bullets(results),
        *planner_bullets(pool, places),
        *unranked_bullets(results),
        "",
    ]


def ranking_bullet(results: dict[str, Any], pool: list[Record], places: list[stats.Ranked], level: float) -> str:
    """The ranking with each run's ratio to the baseline; '>' beyond noise, '~' not separable."""
    by_name = {r["name"]: r for r in pool}
    chain = ""
    for place in places:
        ratio = by_name[place.name].get("ratio_to_baseline")
        chain += f"`{place.name}`" + (f" {ratio[0]:.2f}x" if ratio else "")
        if place.separable_from_next is not None:
            chain += " **>** " if place.separable_from_next else " ~ "
    separable = sum(bool(p.separable_from_next) for p in places)
    base = results["bench"].get("baseline") or "-"
    return (
        f"- **Ranking** at {pool[0]['world_size']} ranks, one per core (tokens/s per device, x `{base}`): {chain}. "
        f"{separable} of {len(places) - 1} neighbouring pairs are separable at {level:.0%} (`>`); `~`: not told "
        "apart by these data."
    )


def precision_bullet(results: dict[str, Any], pool: list[Record]) -> str:
    """How precise the figures are: the widest interval, and the runs over the stopping rule's target."""
    target = (results.get("sweep", {}).get("stopping") or {}).get("target_half_width") or 0.05
    widths = {r["name"]: r.get("tps_per_device_ci_half_width") or 0.0 for r in pool}
    widest = max(widths, key=lambda n: widths[n])
    over = [n for n, w in widths.items() if w > target]
    reps = [len(r.get("repetitions", [])) for r in pool]
    verdict = (
        f"every ranked interval is within +-{target:.0%}"
        if not over
        else f"{len(over)} still wider than +-{target:.0%} when the time budget or the repetition limit ended them: "
        f"{', '.join(f'`{n}`' for n in over)}"
    )
    return (
        f"- **Precision**: {verdict} (widest `{widest}` +-{widths[widest]:.1%}); {min(reps)}-{max(reps)} repetitions "
        "per run."
    )


def article_bullets(results: dict[str, Any]) -> list[str]:
    """Each measured gain over its article table's first row, beside the article's."""
    runs = {r["reference"]: r for r in analysis._ok(results) if r.get("reference")}
    parts = []
    for key, record in runs.items():
        fig = figure(key)
        base = runs.get(fig.baseline)
        if fig.baseline == key or base is None or base["world_size"] != record["world_size"]:
            continue
        gain = record["tps_per_device"] / base["tps_per_device"]
        parts.append(f"{fig.configuration} {gain:.2f}x here vs {article_ratio(key):.2f}x ({fig.table.split(':')[0]})")
    if not parts:
        return []
    return [
        f"- **Versus the article** (gain over the table's first row): {'; '.join(parts)}. The article's gains come "
        "from GPU kernels (compile fusion, FP8 tensor cores) and NVLink; a CPU with gloo measures a different balance."
    ]


def planner_bullets(pool: list[Record], places: list[stats.Ranked]) -> list[str]:
    """The planner's leave-one-out order of the ranked runs against the measured one."""
    predicted = {r["name"]: r["predicted_tps_per_device"] for r in pool if r.get("predicted_tps_per_device")}
    if len(predicted) < 2:
        return []
    measured = {p.name: p.interval.median for p in places if p.name in predicted}
    pairs = list(combinations(measured, 2))
    same = sum((measured[a] - measured[b]) * (predicted[a] - predicted[b]) > 0 for a, b in pairs)
    errors = sorted(abs(r["prediction_error"]) for r in pool if r.get("prediction_error") is not None)
    pick = max(predicted, key=lambda n: predicted[n])
    return [
        f"- **Versus the planner** (`meshforge plan`, calibrated on the other runs of this sweep): it orders "
        f"{same} of {len(pairs)} pairs of ranked runs as measured, and would pick `{pick}` (measured fastest: "
        f"`{places[0].name}`); median absolute error {errors[len(errors) // 2]:.0%} on the ranked runs."
    ]


def unranked_bullets(results: dict[str, Any]) -> list[str]:
    """Rows with more ranks than cores: what they prove (parity, memory), not their speed."""
    rows = [r for r in analysis._ok(results) if r.get("oversubscribed")]
    if not rows:
        return []
    cells = []
    for r in rows:
        parity = r.get("parity") or {}
        diff = parity.get("max_rel_diff")
        verdict = "-" if diff is None else f"loss within {diff:.1e}{'' if parity.get('ok') else ' (OVER tolerance)'}"
        cells.append(f"`{r['name']}` ({r['world_size']} ranks: {verdict}, {r['peak_memory_gib']:.3f} GiB)")
    return [f"- **Not ranked** (more ranks than cores, oversubscribed): {'; '.join(cells)}."]
