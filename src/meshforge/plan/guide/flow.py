"""The guide's outputs from its cells (plan/guide/guide.py): a markdown table, the decision flow as a mermaid graph
derived from the table (each boundary is a GPU count at which the recommended family changes in the table; nothing is
hard-coded), and the article's three command lines regenerated for the hardware."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshforge.plan.search.advisor import SIMPLICITY_MARGIN

ARTICLE_COMMANDS = (
    ("8B", 8, 8192, "model <= 10B: FSDP + compile + Float8 (article: dp_shard 8, compile, Float8)"),
    ("70B", 256, 8192, "10B-100B: FSDP x TP, async TP (article: dp_shard 4 x TP 2, async TP, compile)"),
    (
        "405B",
        512,
        8192,
        "> 100B: 3D/4D, pipeline schedule (article: FSDP 8 x TP 8 x PP 8, interleave_1f1b, Float8)",
    ),
)
"""The article's three example launches: (model, GPU count, seq, what the article gives). The article's second line
(dp 4 x TP 2 = 8 GPUs) cannot hold a 70B model; the GPU count of its table 2 (256) is used."""


def fmt_tps(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _cell(layout: str) -> str:
    """A layout description inside a markdown cell (its ' | ' separators would split the row)."""
    return layout.replace(" | ", "; ")


def table(cells: Sequence[dict[str, Any]]) -> str:
    """One markdown row per cell: recommendation, tokens/s and memory with intervals, runner-up, separable, why."""
    lines = [
        "| model | GPUs | seq | recommended | family | tokens/s/GPU [interval] | memory GiB [interval] / usable "
        "| runner-up (best of another family) | its tokens/s | separable | deciding overheads (runner-up pays) |",
        "|---|---:|---:|---|---|---:|---:|---|---:|---|---|",
    ]
    for c in cells:
        head = f"| {c['model']} | {c['world']} | {c['seq_len']} |"
        b = c["best"]
        if b is None:
            lines.append(f"{head} does not fit | - | - | - | - | - | - | {c['reason']} |")
            continue
        tps = f"{fmt_tps(b['tps'])} [{fmt_tps(b['tps_low'])}-{fmt_tps(b['tps_high'])}]"
        mem = f"{b['memory_gib']:.1f} [{b['memory_low']:.1f}-{b['memory_high']:.1f}] / {b['usable_gib']:.0f}"
        r = c.get("runner_up")
        runner = f"{_cell(r['layout'])} | {fmt_tps(r['tps'])}" if r else "- | -"
        sep = ("yes" if c["separable"] else "no") if r else "-"
        why = ", ".join(c.get("deciding", []))
        lines.append(f"{head} {_cell(b['layout'])} | {b['family']} | {tps} | {mem} | {runner} | {sep} | {why} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Segment:
    """A run of consecutive GPU counts (one model, one sequence length) with the same recommended family."""

    model: str
    seq_len: int
    worlds: tuple[int, ...]
    family: str
    example: str


def recommended_family(cell: dict[str, Any]) -> str:
    return "does not fit" if cell["best"] is None else str(cell["best"]["family"])


def segments(cells: Sequence[dict[str, Any]]) -> list[Segment]:
    """The table cut where the recommendation's family changes along the GPU count (per model and sequence length)."""
    out: list[Segment] = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["model"], c["seq_len"]), []).append(c)
    for (model, seq), group in groups.items():
        group = sorted(group, key=lambda c: c["world"])
        start = 0
        for i in range(1, len(group) + 1):
            if i == len(group) or recommended_family(group[i]) != recommended_family(group[start]):
                first = group[start]
                example = first["best"]["layout"].split(" | ")[0] if first["best"] else first["reason"]
                worlds = tuple(c["world"] for c in group[start:i])
                out.append(Segment(model, seq, worlds, recommended_family(first), example))
                start = i
    return out


def _range(worlds: tuple[int, ...]) -> str:
    return f"{worlds[0]} GPUs" if len(worlds) == 1 else f"{worlds[0]}-{worlds[-1]} GPUs"


def flow(cells: Sequence[dict[str, Any]]) -> str:
    """The guide as a mermaid flowchart: model -> sequence length -> GPU-count ranges -> family (from ``segments``).
    A model whose ranges are the same at every sequence length gets one branch ('any seq')."""
    segs = segments(cells)
    lines = ["flowchart TD", '  start{"model size?"}']
    models = list(dict.fromkeys(s.model for s in segs))
    for mi, model in enumerate(models):
        mine = [s for s in segs if s.model == model]
        seqs = list(dict.fromkeys(s.seq_len for s in mine))
        shape = {seq: [(s.worlds, s.family) for s in mine if s.seq_len == seq] for seq in seqs}
        same = all(shape[seq] == shape[seqs[0]] for seq in seqs)
        lines.append(f'  start --> m{mi}{{"{model}: GPUs, seq?"}}')
        branches = [("any seq", seqs[:1])] if same else [(f"seq {seq:,}", [seq]) for seq in seqs]
        for bi, (label, chosen) in enumerate(branches):
            node = f"m{mi}s{bi}"
            lines.append(f'  m{mi} -->|"{label}"| {node}(("{label}"))')
            for si, s in enumerate(x for x in mine if x.seq_len == chosen[0]):
                leaf = f"{node}r{si}"
                lines.append(f'  {node} -->|"{_range(s.worlds)}"| {leaf}["{s.family}<br/>e.g. {s.example}"]')
    return "\n".join(lines)


def flow_edges(mermaid: str) -> list[tuple[str, str, str]]:
    """(model label, GPU range, family) of every leaf of a flow: what a test compares with ``segments``."""
    labels: dict[str, str] = {}
    out = []
    for line in mermaid.splitlines():
        line = line.strip()
        if line.startswith("start -->"):
            node, label = line.split()[2].split("{", 1)
            labels[node] = label.strip('{}"').split(":")[0]
        elif "|" in line and "[" in line:
            src = line.split()[0]
            model = labels[src.split("s")[0]]
            rng = line.split("|")[1].strip('"')
            fam = line.split('["', 1)[1].split("<br/>")[0]
            out.append((model, rng, fam))
    return out


def command_lines(cells: Sequence[dict[str, Any]], hardware: str) -> list[tuple[str, str]]:
    """(what the article gives, the recommended `meshforge train` command on ``hardware``) for each of its three
    launches, taken from the guide's cell at the same model, GPU count and sequence length."""
    out = []
    for model, world, seq, article in ARTICLE_COMMANDS:
        cell = next(
            (c for c in cells if c["model"] == model and c["world"] == world and c["seq_len"] == seq and c["best"]),
            None,
        )
        if cell is None:
            continue
        flags = shlex.join(cell["best"]["overrides"])
        out.append((article, f"torchrun --nproc-per-node 8 --nnodes {max(1, world // 8)} -m meshforge train {flags}"))
    return out


def markdown(cells: Sequence[dict[str, Any]], hardware: str, stack_note: str = "") -> str:
    """The whole guide as one markdown document: table, mermaid flow, command lines (``hardware``: what --hardware
    named, a preset, a stack or a profile file; ``stack_note``: what a stack profile's constants rest on)."""
    note = (
        f"Within {SIMPLICITY_MARGIN:.0%} of the fastest the search recommends the layout with fewer parallel "
        "dimensions (plan/search/advisor.py), so a runner-up can be slightly faster; 'separable' says whether the "
        "runner-up's tokens/s lies outside the recommendation's interval."
    )
    parts = [f"# meshforge plan --guide --hardware {hardware}", "", *([stack_note, ""] if stack_note else [])]
    parts += [note, "", table(cells), "", "## Decision flow", ""]
    parts += ["```mermaid", flow(cells), "```", "", "## The article's launches, regenerated", ""]
    for article, cmd in command_lines(cells, hardware):
        parts += [f"- {article}:", "", f"  ```\n  {cmd}\n  ```", ""]
    return "\n".join(parts)
