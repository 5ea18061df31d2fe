"""`meshforge plan --guide`: the flags and the run (the table, the flow, the commands and the curves into --out)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from meshforge.config.io import ConfigError
from meshforge.plan import shipped
from meshforge.plan.guide import curves, guide
from meshforge.plan.guide import flow as guide_flow
from meshforge.plan.hardware import HardwareProfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --guide flags (grouped, so plan/cli.py only calls this)."""
    g = parser.add_argument_group("guide (--guide)")
    g.add_argument("--guide", action="store_true", help="the strategy-selection guide: table, flow, commands, curves")
    g.add_argument("--world-sizes", default=",".join(map(str, guide.DEFAULT_WORLD_SIZES)), help="GPU counts")
    g.add_argument("--seq-lens", default=",".join(map(str, guide.DEFAULT_SEQ_LENS)), help="sequence lengths")
    g.add_argument("--models", default=",".join(guide.DEFAULT_MODELS), help="model flavors (or --model.* overrides)")
    g.add_argument("--with-results", metavar="RESULTS_JSON", help="meshforge bench results drawn on the curves")
    g.add_argument("--no-cache", action="store_true", help="search every cell again (ignore the on-disk cache)")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated integers, e.g. 8,64,256") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: give positive integers, e.g. 8,64,256")
    return sorted(set(values))


def models_of(opts: argparse.Namespace, overrides: list[str]) -> list[list[str]]:
    """One override list per model: the --model.* overrides as one model when given, else one per --models flavor."""
    if any(o.startswith("--model.") for o in overrides):
        return [overrides]
    if overrides:
        raise ConfigError(f"--guide takes only --model.* overrides, not {overrides[0]}; the search picks the rest")
    flavors = list(dict.fromkeys(m.strip() for m in opts.models.split(",") if m.strip()))
    if not flavors:
        raise ConfigError(f"--models {opts.models!r} names no model: give comma-separated flavors, e.g. 8B,70B")
    from meshforge.model.flavors import get_flavor

    for flavor in flavors:
        get_flavor(flavor)  # an unknown name: one line listing the known ones, before any cell is searched
    return [["--model.flavor", m] for m in flavors]


def run_guide(opts: argparse.Namespace, overrides: list[str], hw: HardwareProfile) -> int:
    """Compute the guide, print it (markdown or --json) and write guide.md, guide.json and the curves into --out."""
    start = time.perf_counter()
    worlds = _ints(opts.world_sizes, "--world-sizes")
    seqs = _ints(opts.seq_lens, "--seq-lens")
    cells = guide.compute_guide(
        hw, models_of(opts, overrides), worlds, seqs, impl=opts.impl, use_cache=not opts.no_cache
    )
    text = guide_flow.markdown(cells, opts.hardware, stack_note(hw, worlds))
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        pngs = curves.write_curves(cells, hw.name, out, opts.with_results)
        text += "\n## Throughput curves\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs)
        (out / "guide.md").write_text(text + "\n")
        (out / "guide.json").write_text(json.dumps(cells, indent=1) + "\n")
    if opts.json:
        print(json.dumps(cells, indent=1))
    else:
        print(text)
        print(f"\n{len(cells)} cells in {time.perf_counter() - start:.1f} s")
    return 0


def stack_note(hw: HardwareProfile, worlds: list[int]) -> str:
    """For a stack profile: the runs its constants rest on and, where the guide goes past the one node they measured,
    that the inter-node constants there are the hardware's (report.stack_note's line, for the whole guide)."""
    info = hw.stack
    if info is None:
        return ""
    fitted = ", ".join(info.fitted) or "nothing"
    text = f"Stack {info.name!r}: fitted {fitted} from runs on {', '.join(map(str, info.world_sizes)) or 'no'} GPUs."
    node = hw.spec.devices_per_node
    wider = [w for w in worlds if w > node]
    if info.world_sizes and max(info.world_sizes) <= node and wider:
        held = "inter-node links" + (f" and {', '.join(info.held)}" if info.held else "")
        text += (
            f" Its runs fit in one node ({node} GPUs): the cells at {', '.join(map(str, wider))} GPUs use "
            f"{info.hardware}'s {held} (not this stack's), and their intervals' +-1 sd is "
            f"{max(hw.efficiency.tps_log_sd, shipped.SPLIT_LOG_SD):.3f}: at least the measured one-node -> multi-node "
            "error (shipped.SPLIT_LOG_SD; interval.tps_spread)."
        )
    return text
