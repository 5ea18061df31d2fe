"""results.json -> loss parity per run, and report.md: the article's tables (configuration, TPS/device, memory, ratio
to the baseline) filled with what was measured here. Every number in the report is formatted from results.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshforge.bench import analysis, auto_rows, ft_rows
from meshforge.bench import guide as bench_guide
from meshforge.bench.reference import CLAIMS, article_ratio, figure
from meshforge.bench.takeaway import takeaway_lines
from meshforge.model.flavors import MFU_CAUSAL_LABEL, MFU_LABEL

MFU_LABELS = f"*MFU %*: {MFU_LABEL}; *MFU % causal*: {MFU_CAUSAL_LABEL}."

Record = dict[str, Any]


def fmt(value: Any, digits: int = 1) -> str:
    """A figure as the report prints it ('-' when missing)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def fmt_diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def ok_records(results: dict[str, Any]) -> list[Record]:
    return [r for r in results["runs"] if r["status"] == "ok"]


def parity_reference(results: dict[str, Any], record: Record) -> Record | None:
    """The run ``record`` is compared with: the baseline at the same sequence length, else the first plain run
    (no compile, no Float8) at that length. Every run of a matrix trains the same model on the same global batch."""
    key = ("seq_len", "global_batch_size", "steps", "dtype")
    same = [r for r in ok_records(results) if all(r[k] == record[k] for k in key)]
    baseline = results["bench"].get("baseline")
    for r in same:
        if r["name"] == baseline:
            return r
    plain = [r for r in same if not r["flags"]["compile"] and not r["flags"]["float8"]]
    return plain[0] if plain else None


def attach_parity(results: dict[str, Any], rtol_of: dict[str, float]) -> None:
    """Add ``parity`` to each ok record: max relative loss difference to its reference over all steps, and ok."""
    for record in results["runs"]:
        record["parity"] = None
        if record["status"] != "ok":
            continue
        ref = parity_reference(results, record)
        if ref is None:
            continue
        want = dict((step, loss) for step, loss in ref["loss_curve"])
        diffs = [abs(loss - want[step]) / abs(want[step]) for step, loss in record["loss_curve"] if step in want]
        final = record["loss_curve"][-1] if record["loss_curve"] else None
        rtol = rtol_of.get(record["name"], results["bench"]["parity_rtol"])
        max_diff = max(diffs) if diffs else None
        record["parity"] = {
            "reference": ref["name"],
            "rtol": rtol,
            "steps_compared": len(diffs),
            "max_rel_diff": max_diff,
            "final_rel_diff": None if final is None or final[0] not in want else diffs[-1],
            "ok": max_diff is not None and max_diff <= rtol,
        }


def ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def parity_cell(record: Record) -> str:
    """'reference' for the run others are compared with, else the max relative loss difference and the verdict."""
    parity = record.get("parity") or {}
    if not parity:
        return "-"
    if parity["reference"] == record["name"]:
        return "reference"
    return f"{fmt_diff(parity['max_rel_diff'])} {'ok' if parity['ok'] else '**over tol**'}"


def baseline_record(results: dict[str, Any]) -> Record | None:
    name = results["bench"].get("baseline")
    return next((r for r in ok_records(results) if r["name"] == name), None)


def main_table(results: dict[str, Any]) -> list[str]:
    """Every run: the article's columns (configuration, TPS/device, memory) plus the interval, the ratio to the
    baseline with its interval, the planner's leave-one-out prediction, loss and parity."""
    base = baseline_record(results)
    base_mem = base["peak_memory_gib"] if base else None
    level = analysis.confidence_of(results)
    lines = [
        f"| Configuration | Ranks | TPS/device (median) | {level:.0%} CI | vs baseline ({level:.0%} CI) | Job tokens/s "
        "| TFLOPs | MFU % | MFU % causal | Memory GiB | Memory vs baseline | Predicted (leave-one-out) | Error "
        "| Loss at last step | Parity (max rel. diff) | Status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in (r for r in results["runs"] if r["group"] != "scaling"):
        predicted, error = analysis.prediction_cells(r)
        lines.append(
            f"| {r['label']} (`{r['name']}`) | {ranks_cell(r)} | {fmt(r['tps_per_device'])} | "
            f"{analysis.ci_cell(r)} | {analysis.ratio_cell(r)} | "
            f"{fmt(r['job_tps'])} | {fmt(r['tflops'], 4)} | {fmt(r['mfu_pct'], 2)} | "
            f"{fmt(r.get('mfu_causal_pct'), 2)} | {fmt(r['peak_memory_gib'], 3)} | "
            f"{ratio(r['peak_memory_gib'], base_mem)} | {predicted} | {error} | {fmt(r['final_loss'], 4)} | "
            f"{parity_cell(r)} | {r['status']} |"
        )
    lines.append(
        "\n`*`: the ratio's interval excludes 1 (faster or slower than the baseline beyond noise). Memory is the "
        "peak over the measured steps of all repetitions. *Oversubscribed*: more ranks than cores, so its ranks "
        "time-slice the cores; the row shows that the layout trains the same model (parity) and what it holds "
        "(memory); its speed is not ranked. " + MFU_LABELS
    )
    return lines


def ranks_cell(record: Record) -> str:
    return f"{record['world_size']} (oversubscribed)" if record.get("oversubscribed") else str(record["world_size"])


def scaling_tables(results: dict[str, Any]) -> list[str]:
    """Per scaling series: per-device throughput at N ranks over that at the fewest ranks (scaling efficiency)."""
    by_name = {r["name"]: r for r in results["runs"]}
    cores = results["machine"].get("cpu_cores") or 0
    lines: list[str] = []
    for series, names in results["bench"].get("scaling", {}).items():
        rows = sorted((by_name[n] for n in names if n in by_name), key=lambda r: r["world_size"])
        first = next((r for r in rows if r["status"] == "ok"), None)
        lines += [
            f"\n### Scaling: `{series}` (same global batch; fewer ranks use gradient accumulation)\n",
            "| Ranks | Ranks per core | TPS/device | Scaling efficiency | Job tokens/s | Memory GiB "
            "| Parity (max rel. diff) | Status |",
            "|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            eff = None
            if first and r["status"] == "ok" and first["tps_per_device"]:
                eff = 100 * r["tps_per_device"] / first["tps_per_device"]
            per_core = f"{r['world_size'] / cores:.1f}" if cores and results["machine"]["device"] == "cpu" else "-"
            lines.append(
                f"| {r['world_size']} | {per_core} | {fmt(r['tps_per_device'])} | "
                f"{'-' if eff is None else f'{eff:.0f}%'} | {fmt(r['job_tps'])} | {fmt(r['peak_memory_gib'], 3)} | "
                f"{parity_cell(r)} | {r['status']} |"
            )
    return lines


def group_table(results: dict[str, Any], title: str, rows: list[Record], extra: str) -> list[str]:
    """A small table of related runs (pipeline schedules, context lengths)."""
    if not rows:
        return []
    lines = [
        f"\n### {title}\n",
        f"| Configuration | Seq len | TPS/device | Memory GiB | {extra} | Status |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        value = fmt(r["bubble_pct"]) if extra.startswith("Bubble") else fmt(r["step_time_s"], 3)
        lines.append(
            f"| {r['label']} | {r['seq_len']} | {fmt(r['tps_per_device'])} | {fmt(r['peak_memory_gib'], 3)} | "
            f"{value} | {r['status']} |"
        )
    return lines


def failures(results: dict[str, Any]) -> list[str]:
    bad = [r for r in results["runs"] if r["status"] != "ok" or r.get("error")]
    if not bad:
        return ["\nEvery configuration ran."]
    lines = ["\n## Configurations that did not run\n", "| Run | Status | Reason |", "|---|---|---|"]
    for r in bad:
        lines.append(f"| `{r['name']}` | {r['status']} | {r['error'].replace('|', '/')} |")
    return lines


def winner_lines(results: dict[str, Any]) -> list[str]:
    """Which strategy wins here, by per-device throughput and by memory, among runs at the baseline's world size."""
    base = baseline_record(results)
    pool = analysis.ranked_pool(results) or [r for r in ok_records(results) if r["group"] == "strategy"]
    if not pool:
        return ["No strategy finished: see the failures below."]
    fastest = max(pool, key=lambda r: r["tps_per_device"])
    leanest = min(pool, key=lambda r: r["peak_memory_gib"])
    return [
        f"- **Fastest** at {fastest['world_size']} ranks: {fastest['label']}, {fmt(fastest['tps_per_device'])} "
        f"tokens/s per device ({ratio(fastest['tps_per_device'], base['tps_per_device'] if base else None)} the "
        f"baseline){analysis.runner_up_note(results, fastest, pool)}.",
        f"- **Least memory**: {leanest['label']}, {fmt(leanest['peak_memory_gib'], 3)} GiB peak per rank.",
    ]


def setup_lines(results: dict[str, Any]) -> list[str]:
    """What was measured, on what, and what the hardware does to the figures."""
    bench, machine, sweep = results["bench"], results["machine"], results.get("sweep", {})
    lines = [
        f"- Matrix `{bench['name']}` ({bench['source'] or 'built in'}): {bench['description']}".rstrip(": "),
        f"- Model `{bench['flavor']}`, {bench['dtype']}, seq {bench['seq_len']} and global batch "
        f"{bench['global_batch_size']} sequences (unless a run states otherwise), same seed and data for every run: "
        "the loss curves of runs with the same sequence length and batch must coincide.",
        f"- {bench['warmup_steps']} warm-up steps (not timed), then {bench['measured_steps']} measured steps per "
        "repetition; each figure is the median over the measured steps of all repetitions, with a confidence "
        "interval (CI: Student's t over the repetitions' medians). Memory: peak over the measured steps, maximum "
        "over ranks.",
    ]
    if machine["device"] == "cuda":
        lines.append(f"- Hardware: {machine['gpus']} x {machine['gpu_name']} per node, NCCL; torch {machine['torch']}.")
    else:
        lines.append(
            f"- Hardware: {machine['cpu']}, **{machine['cpu_cores']} CPU cores, no GPU**; gloo; torch "
            f"{machine['torch']}. Load average before the sweep: {fmt(machine.get('load_avg_1m_before'), 2)}."
        )
        lines += cpu_caveats(machine["cpu_cores"])
    lines += analysis.machine_lines(results)
    if bench.get("note"):
        lines.append(f"- {bench['note']}")
    if sweep:
        lines.append(
            f"- This sweep: {sweep.get('ran', 0)} runs executed, {sweep.get('reused', 0)} reused from an earlier "
            f"sweep; wall time {fmt(sweep.get('wall_s'))} s. {launcher_line(sweep.get('launcher') or {})}"
        )
    return lines


def launcher_line(launcher: dict[str, Any]) -> str:
    """How the sweep's ranks were started (bench/warm.py, or torchrun)."""
    if launcher.get("kind") == "warm":
        return (
            "Ranks were forked from one warm process (torch imported once, "
            f"{fmt(launcher.get('import_s'))} s) with the environment torchrun gives its workers (docs/bench.md)."
        )
    return "Every run was started by torchrun (one Python process per rank)."


def cpu_caveats(cores: int) -> list[str]:
    return [
        f"- **One rank per core.** Each rank is a process with one thread; up to {cores} ranks every rank has a core "
        "of its own, so the strategies are ranked at the rank count where that holds (bench/ranks.py). A run with "
        "more ranks than cores (the 2D and 3D compositions here) time-slices the cores: a 'device' there is a share "
        "of a core, and its per-device figure measures the scheduler as much as the layout, so it is marked "
        "*oversubscribed* and not ranked; it proves loss parity and memory.",
        "- Collectives go through gloo on one host (shared memory / loopback TCP) and cost far more relative to the "
        "tiny model's compute than NCCL on NVLink does for an 8B model, so communication-heavy layouts (TP, CP) "
        "look worse here than on GPUs. A pipeline rank waiting in the bubble hands its core to another rank, so "
        "the bubble (still measured: Bubble %) costs less time here than on GPUs, where an idle GPU is wasted. "
        "torch.compile gains little on a CPU, and CPUs have no Float8 matmuls (a Float8 run here is emulated or "
        "slow). MFU is against a CPU matmul peak measured at start-up, not a datasheet.",
    ]


def reference_table(results: dict[str, Any]) -> list[str]:
    """The article's figures beside the measured ones (absolute figures only where the setup matches)."""
    rows = [r for r in results["runs"] if r.get("reference")]
    if not rows:
        return ["\nNo run of this matrix names an article figure (`reference = ...`)."]
    by_ref = {r["reference"]: r for r in rows}
    lines = [
        "\n## Measured vs the article\n",
        "Absolute figures compare only where the setup matches (model, world size, layout, sequence length); "
        "elsewhere compare the gain over the table's first row.\n",
        "| Run | Article row | Setup matches | TPS/device | Article TPS/GPU | Memory GiB | Article GiB "
        "| Gain (measured) | Gain (article) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fig = figure(r["reference"])
        base = by_ref.get(fig.baseline)
        gain = ratio(r["tps_per_device"], base["tps_per_device"] if base and base["status"] == "ok" else None)
        match = fig.matches(r)
        lines.append(
            f"| `{r['name']}` | {fig.table.split(':')[0]}: {fig.configuration} | {'yes' if match else 'no'} | "
            f"{fmt(r['tps_per_device'])} | {fmt(fig.tps_per_gpu, 0) if match else f'({fig.tps_per_gpu:,.0f})'} | "
            f"{fmt(r['peak_memory_gib'], 3)} | {fmt(fig.memory_gib) if match else f'({fig.memory_gib:.1f})'} | "
            f"{gain} | {article_ratio(fig.key):.2f}x |"
        )
    tables = sorted({figure(r["reference"]).table for r in rows})
    lines += ["", *[f"- {t}" for t in tables], *[f"- Article claim: {c}" for c in CLAIMS]]
    return lines


def timing_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "\n## Run times\n",
        "Per repetition (medians over the repetitions): start-up is the wall time outside the steps (process start, "
        "imports, set-up, shutdown), reported apart from the steady-state step time.\n",
        "| Run | Wall s | Start-up s | Step time s (median) | Load average (1 min) at the end |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| `{r['name']}` | {fmt(r['wall_s'])} | {fmt(r['startup_s'])} | {fmt(r['step_time_s'], 3)} | "
            f"{fmt(r.get('load_avg_1m'), 2)} |"
        )
    return lines


PLOTS = (
    ("throughput.png", "Throughput per strategy (tokens/s per device, higher is better)"),
    ("scaling.png", "Throughput vs number of ranks (higher is better)"),
    ("memory.png", "Peak memory per strategy (GiB per rank, lower is better)"),
    ("loss.png", "Loss curves, all strategies overlaid"),
    ("prediction.png", "The planner's leave-one-out prediction vs the measurement"),
)


def render_report(results: dict[str, Any], *, compare_with: str = "", plots_prefix: str = "") -> str:
    """The whole report.md as text."""
    records = results["runs"]
    pp_rows = [r for r in records if r["layout"]["pp"] > 1]
    cp_rows = [r for r in records if r["group"] == "context" or r["layout"]["cp"] > 1]
    lines = [
        f"# meshforge bench: {results['bench']['name']}",
        "",
        *takeaway_lines(results),
        *analysis.noise_lines(results),
        *winner_lines(results),
        "",
        "## Setup",
        "",
        *setup_lines(results),
        "",
        f"## Strategies (baseline: `{results['bench'].get('baseline') or '-'}`)",
        "",
        *main_table(results),
        *auto_rows.report_lines(results),
        *ft_rows.cost_lines(results),
        *analysis.prediction_lines(results),
        *analysis.ranking_lines(results),
        *bench_guide.guide_lines(results),
        *scaling_tables(results),
        *group_table(results, "Pipeline schedules", pp_rows, "Bubble %"),
        *group_table(results, "Context parallel at several sequence lengths", cp_rows, "Step time s"),
        *failures(results),
        *analysis.statistics_table(results),
    ]
    if compare_with == "reference":
        lines += reference_table(results)
    lines += ["", "## Plots", ""]
    lines += [f"![{title}]({plots_prefix}{name})" for name, title in PLOTS]
    lines += timing_table(results)
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out_dir: Path, *, compare_with: str = "") -> Path:
    path = out_dir / "report.md"
    path.write_text(render_report(results, compare_with=compare_with))
    return path
