"""`meshforge bench compare OLD/results.json NEW/results.json [--fail-above 5%]`: what changed between two sweeps.

Every run present and finished in both files gets a row: its median tokens/s per device before and after, the change,
and the bootstrap interval of the ratio new / old (bench/stats.py, from the raw per-step values both files keep).
A change is *beyond noise* when that interval excludes 1. A *regression* is a change beyond noise that is slower by
more than ``--fail-above`` (a percentage of the old median); the command then exits 1, so CI can gate on it. Files
written before the sweep kept per-step values (schema 1) have no interval: their changes are judged on the threshold
alone and marked so.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from meshforge.bench import stats
from meshforge.config.io import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"meshforge bench compare: {message}")


@dataclass(frozen=True)
class Change:
    """One run of both sweeps."""

    name: str
    old: float
    new: float
    ratio: stats.Interval | None  # None when a file lacks per-step values
    threshold: float

    @property
    def change(self) -> float:
        return self.new / self.old - 1

    @property
    def beyond_noise(self) -> bool | None:
        return None if self.ratio is None else self.ratio.excludes(1.0)

    @property
    def regression(self) -> bool:
        """Slower by more than the threshold, and (where an interval exists) beyond noise."""
        return self.change < -self.threshold and self.beyond_noise is not False

    def verdict(self) -> str:
        if self.regression:
            return "**REGRESSION**"
        if self.beyond_noise is None:
            return "no interval"
        if not self.beyond_noise:
            return "noise"
        return "faster" if self.change > 0 else "slower (within threshold)"


def parse_threshold(text: str) -> float:
    """'5%' or '5' -> 0.05."""
    try:
        value = float(text.strip().rstrip("%")) / 100
    except ValueError:
        raise ConfigError(f"--fail-above {text!r}: give a percentage such as 5%") from None
    if value < 0:
        raise ConfigError(f"--fail-above {text!r}: the threshold must be >= 0%")
    return value


def read(path: str) -> dict[str, dict[str, Any]]:
    """name -> record of the finished runs of a results.json."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"meshforge bench compare: {path} does not exist (meshforge bench writes DIR/results.json)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"meshforge bench compare: {path} is not valid JSON ({exc})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise ConfigError(f"meshforge bench compare: {path} is not a results.json written by `meshforge bench`")
    return {r["name"]: r for r in runs if r.get("status") == "ok" and r.get("tps_per_device")}


def changes(
    old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]], threshold: float, confidence: float
) -> list[Change]:
    """One Change per run finished in both, in the new file's order."""
    out = []
    for name, after in new.items():
        before = old.get(name)
        if before is None:
            continue
        ratio = None
        if before.get("tps_steps") and after.get("tps_steps"):
            ratio = stats.ratio_ci(after["tps_steps"], before["tps_steps"], confidence)
        out.append(Change(name, before["tps_per_device"], after["tps_per_device"], ratio, threshold))
    return out


def table(rows: list[Change], confidence: float) -> list[str]:
    lines = [
        f"| Run | Old TPS/device | New TPS/device | Change | New / old ({confidence:.0%} CI) | Verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for c in rows:
        interval = "-" if c.ratio is None else f"{c.ratio.low:.3f}-{c.ratio.high:.3f}"
        lines.append(f"| `{c.name}` | {c.old:,.1f} | {c.new:,.1f} | {c.change:+.1%} | {interval} | {c.verdict()} |")
    return lines


def main(argv: list[str]) -> int:
    """Print the comparison; 1 if any run regressed beyond the threshold, else 0."""
    parser = _Parser(prog="meshforge bench compare", description=__doc__)
    parser.add_argument("old", help="the earlier sweep's results.json")
    parser.add_argument("new", help="the later sweep's results.json")
    parser.add_argument("--fail-above", default="5%", help="slowdown beyond noise that fails (default 5%%)")
    parser.add_argument("--confidence", type=float, default=stats.CONFIDENCE, help="interval level (default 0.95)")
    parser.add_argument("--agree", type=parse_threshold, default=0.10, help="agreement tolerance (default 10%%)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if not 0.5 <= args.confidence < 1:
        raise ConfigError(f"--confidence {args.confidence}: use a level in [0.5, 1), e.g. 0.95")
    threshold = parse_threshold(args.fail_above)
    old, new = read(args.old), read(args.new)
    rows = changes(old, new, threshold, args.confidence)
    regressions = [c.name for c in rows if c.regression]
    if args.json:
        print(json.dumps({"threshold": threshold, "regressions": regressions, "runs": [as_dict(c) for c in rows]}))
        return 1 if regressions else 0
    print(f"meshforge bench compare: {args.old} -> {args.new} (fail above {threshold:.1%} slower, beyond noise)\n")
    print("\n".join(table(rows, args.confidence)))
    only_old, only_new = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    for label, names in (("only in the old sweep", only_old), ("only in the new sweep", only_new)):
        if names:
            print(f"\n{label}: {', '.join(names)}")
    print("\n" + "\n".join(agreement(old, new, args.agree, args.confidence)))
    print("\n".join(speed_lines(args.old, args.new, old, new, args.agree, args.confidence)))
    print(precision_line(old, new))
    print(f"\n{len(regressions)} regression(s){': ' + ', '.join(regressions) if regressions else ''}")
    return 1 if regressions else 0


def order_flips(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]], confidence: float) -> list[str]:
    """Pairs of common runs that either sweep calls separable, ordered differently by the other sweep's medians."""
    common = [n for n in new if n in old and old[n].get("tps_steps") and new[n].get("tps_steps")]
    flips = []
    for side, other in ((old, new), (new, old)):
        pairs = stats.separable_pairs({n: side[n]["tps_steps"] for n in common}, confidence)
        for pair, faster in pairs.items():
            a, b = pair.split("|")
            slower = b if faster == a else a
            if other[faster]["tps_per_device"] <= other[slower]["tps_per_device"] and pair not in flips:
                flips.append(pair)
    return flips


def agreement(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]], within: float, level: float) -> list[str]:
    """Do two sweeps of the same matrix agree? Every common run's median within ``within`` of the other's, and the
    same order for every pair that either sweep calls separable. Runs with more ranks than cores (``oversubscribed``:
    their speed is the scheduler's, bench/ranks.py) are listed apart and left out of the verdict."""
    crowded = sorted(n for n in new if n in old and (new[n].get("oversubscribed") or old[n].get("oversubscribed")))
    moved = [f"{n} {new[n]['tps_per_device'] / old[n]['tps_per_device'] - 1:+.1%}" for n in crowded]
    old = {n: r for n, r in old.items() if n not in crowded}
    common = [n for n in new if n in old]
    change = {n: new[n]["tps_per_device"] / old[n]["tps_per_device"] - 1 for n in common}
    far = [n for n in common if abs(change[n]) > within]
    flips = order_flips(old, new, level)
    verdict = "agree" if not far and not flips else "DO NOT agree"
    flipped = f" ({', '.join(p.replace('|', ' vs ') for p in flips)})" if flips else ""
    widest = max(common, key=lambda n: abs(change[n]), default=None)
    most = f"; largest change {widest} {change[widest]:+.1%}" if widest else ""
    lines = [
        f"Agreement: the sweeps {verdict} (medians within {within:.0%}: {len(common) - len(far)} of {len(common)} "
        f"runs{'; beyond: ' + ', '.join(far) if far else ''}{most}; pairs separable in either sweep and ordered "
        f"differently by the other: {len(flips)}{flipped})"
    ]
    if crowded:
        lines.append(f"Not in the verdict (more ranks than cores, not ranked on speed): {', '.join(moved)}")
    return lines


def precision_line(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]], target: float = 0.05) -> str:
    """How many runs of each sweep (those with a core per rank) have an interval within +-``target``."""
    cells = []
    for label, runs in (("old", old), ("new", new)):
        ranked = [r for r in runs.values() if not r.get("oversubscribed")]
        within = [r for r in ranked if (r.get("tps_per_device_ci_half_width") or float("inf")) <= target]
        cells.append(f"{label} {len(within)} of {len(ranked)}")
    return f"Intervals within +-{target:.0%} (runs with a core per rank): {', '.join(cells)}"


def machine_speed(path: str) -> float | None:
    """The median of a sweep's machine-speed probes (bench/machine.py), None for files written before them."""
    data = json.loads(Path(path).read_text())
    speed = ((data.get("sweep") or {}).get("machine_speed") or {}).get("median")
    return float(speed) if speed else None


def speed_lines(
    old_path: str,
    new_path: str,
    old: dict[str, dict[str, Any]],
    new: dict[str, dict[str, Any]],
    within: float,
    level: float,
) -> list[str]:
    """The machine's own speed in both sweeps and, when it moved, the agreement with that change divided out (an
    aid to reading: the verdict above, on the raw figures, is the one that counts)."""
    before, after = machine_speed(old_path), machine_speed(new_path)
    if before is None or after is None:
        return []
    ratio = after / before
    lines = [f"Machine speed (matmul probe on all cores between repetition rounds): {before:.1f} -> {after:.1f} "
             f"GFLOP/s ({ratio - 1:+.1%})"]  # fmt: skip
    if abs(ratio - 1) > 0.01:
        scaled = {n: r | {"tps_per_device": r["tps_per_device"] / ratio} for n, r in new.items()}
        lines += [line.replace("Agreement:", "With the machine's change divided out:", 1)
                  for line in agreement(old, scaled, within, level)]  # fmt: skip
    return lines


def as_dict(c: Change) -> dict[str, Any]:
    return {
        "name": c.name,
        "old": c.old,
        "new": c.new,
        "change": c.change,
        "ratio_ci": None if c.ratio is None else [c.ratio.low, c.ratio.high],
        "beyond_noise": c.beyond_noise,
        "regression": c.regression,
    }
