"""Text and JSON renderings of estimates and search results (what `meshforge plan` prints)."""

from __future__ import annotations

from typing import Any

from meshforge.model.flavors import MFU_CAUSAL_LABEL, MFU_LABEL, param_counts
from meshforge.plan import shipped
from meshforge.plan.accuracy import fit as fitting
from meshforge.plan.accuracy.fit import Fit, MemoryFit
from meshforge.plan.accuracy.interval import Interval, difference_sd, interval, past_runs, separable
from meshforge.plan.accuracy.interval import unit as interval_unit
from meshforge.plan.accuracy.stack_fit import StackFit
from meshforge.plan.hardware import GIB, HardwareProfile, StackInfo
from meshforge.plan.layout import layout_args
from meshforge.plan.physics.estimate import Estimate
from meshforge.plan.physics.memory import STATE_BYTES
from meshforge.plan.physics.parts import MAX_LOAD, routed_rank_numel
from meshforge.plan.search.advisor import SearchResult, best_by, complexity
from meshforge.plan.search.lever_search import explain

TIME_LABELS = {
    "compute": "compute (matmuls, attention, element-wise)",
    "exposed_fsdp_comm": "exposed FSDP all-gather / reduce-scatter",
    "exposed_tp_comm": "exposed TP all-gather / reduce-scatter",
    "exposed_cp_comm": "exposed CP K/V exchange",
    "exposed_pp_comm": "exposed PP send / receive",
    "exposed_ep_comm": "MoE token all-to-all (never overlapped)",
    "pipeline_bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "chunked_loss_recompute": "chunked loss: the head's forward again in backward",
    "activation_offload_copies": "activation offload: exposed host copies",
    "cpu_offload_copies": "CPU offload: exposed parameter / gradient copies",
}
"""Every term of `Estimate.time` (physics/estimate.py, physics/levers.py): a term without a label fails
tests/unit/test_plan_report_terms.py."""
MEMORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "communication_buffers": "communication buffers",
    "allocator_slack": "allocator slack",
    "framework_overhead": "framework overhead",
    "host_offloaded": "on the host (not in peak)",
}
"""Every term of the memory breakdown (physics/peak.py's ``as_dict``), as the text report names it."""
SHORT = {
    "compute": "compute",
    "exposed_fsdp_comm": "FSDP comm",
    "exposed_tp_comm": "TP comm",
    "exposed_cp_comm": "CP comm",
    "exposed_pp_comm": "PP comm",
    "exposed_ep_comm": "EP comm",
    "pipeline_bubble": "bubble",
    "optimizer": "optimizer",
    "chunked_loss_recompute": "chunked-loss recompute",
    "activation_offload_copies": "activation offload",
    "cpu_offload_copies": "CPU offload copies",
}


def format_estimate(est: Estimate, hw: HardwareProfile, iv: Interval | None = None) -> str:
    """The human-readable prediction for one layout (with its interval and memory verdict when given)."""
    lay = est.layout
    lines = [
        f"meshforge plan: {lay.flavor} ({param_counts(layout_args(lay)).total:,} parameters) on {lay.world_size} x "
        f"{hw.name} ({hw.spec.description})",
        f"layout: {lay.describe()}",
        *sync_line(est),
        "",
        f"peak memory per device (GiB), pipeline rank {est.memory.rank}:",
    ]
    for key, value in est.memory.as_dict().items():
        lines.append(f"  {MEMORY_LABELS[key]:<28} {value:8.2f}")
    usable = est.capacity_gib - est.runtime_gib
    verdict = "fits" if est.fits else "DOES NOT FIT"
    if iv is not None:
        verdict = memory_verdict(est, iv)
    lines.append(f"  {'peak':<28} {est.peak_memory_gib:8.2f}   of {usable:.1f} usable -> {verdict}")
    if est.runtime_gib:  # issue 44.5: the reserves the verdict assumes, stated
        lines.append(
            f"  (usable: the device's {est.capacity_gib:.1f} GiB less {est.runtime_gib:.1f} outside the allocator, "
            "CUDA context and NCCL buffers, assumed; the allocator's slack is the fitted line above)"
        )
    lines += moe_lines(est)
    lines += ["", f"step time (s), {est.layout.tokens_per_device_step:,.0f} tokens per device per step:"]
    for key, value in est.time.items():
        lines.append(f"  {TIME_LABELS[key]:<50} {value:9.4f}  {value / est.step_time:6.1%}")
    lines.append(f"  {'total':<50} {est.step_time:9.4f}")
    lines += ["", f"tokens/s per device: {est.tps_per_device:,.1f}    MFU: {est.mfu_pct:.1f} %"]
    lines += [f"  {MFU_LABEL}: {est.mfu_pct:.1f} %; {MFU_CAUSAL_LABEL}: {est.mfu_causal_pct:.1f} %"]
    if iv is not None:
        lines.append(
            f"interval (+-1 sd; {iv.spread or 'spread + constants covariance'}): {iv.tps_low:,.1f} - "
            f"{iv.tps_high:,.1f} tokens/s, {iv.memory_low:.1f} - {iv.memory_high:.1f} GiB"
        )
    note = stack_note(est, hw)
    lines += [note] if note else []
    lines += [line for line in [exchange_note(est)] if line]
    lines += [f"warning: {w}" for w in est.warnings]
    return "\n".join(lines)


def sync_line(est: Estimate) -> list[str]:
    """The gradient exchange as priced, where data-parallel gradients accumulate over micro-steps (auto resolved)."""
    lay, (mode, regather) = est.layout, est.sync
    if lay.grad_accum <= 1 or not (lay.fsdp_size > 1 or lay.dp_replicate > 1) or not mode:
        return []
    text = {"once_per_step": "once per step", "every_microstep": "every micro-step"}.get(mode, mode)
    if mode == "once_per_step" and lay.pp == 1:
        text += ", parameters " + ("kept gathered" if regather == "keep" else "re-gathered") + " between micro-steps"
    asked = [f"{k} auto" for k, v in (("mode", lay.gradient_sync), ("regather", lay.regather)) if v == "auto"]
    return [f"gradient sync: {text}" + (f" ({', '.join(asked)}: decided by memory)" if asked else "")]


def exchange_note(est: Estimate, share: float = 0.1) -> str:
    """One line on an exposed FSDP exchange under gradient accumulation: what is still exposed and why."""
    lay, exposed = est.layout, est.time.get("exposed_fsdp_comm", 0.0)
    if lay.grad_accum <= 1 or lay.fsdp_size <= 1 or exposed < share * est.step_time:
        return ""
    mode, regather = est.sync if est.sync[0] else (lay.gradient_sync, lay.regather)
    if mode == "every_microstep":
        why = "gradients are reduce-scattered every micro-step (--gradient_sync.mode once_per_step exchanges them once)"
    elif regather != "keep":
        held = "regather auto: keeping them would not fit" if lay.regather == "auto" else "at more memory"
        why = (
            "the parameters are re-gathered for every micro-step's forward and backward "
            f"(--gradient_sync.regather keep holds them gathered between micro-steps; {held})"
        )
    else:
        why = "the forward's all-gathers of each step outlast the compute that hides them"
    return (
        f"exposed: FSDP {exposed:.2f} s of {est.step_time:.2f} s per step over {lay.fsdp_size} ranks x "
        f"{lay.grad_accum} micro-steps: {why}"
    )


def stack_note(est: Estimate, hw: HardwareProfile) -> str:
    """For a stack profile: what its constants rest on, and, past what its runs measured (more nodes; on a CPU, more
    ranks), that the interval's spread is then at least the one-node -> multi-node split's (interval.tps_spread)."""
    info = hw.stack
    if info is None:
        return ""
    unit, world = interval_unit(hw), est.layout.world_size
    text = f"stack {info.name!r}: fitted {', '.join(info.fitted) or 'nothing'} from runs on {_worlds(info)} {unit}"
    if not past_runs(est.layout, hw):
        return text
    node, most = hw.spec.devices_per_node, max(info.world_sizes)
    floor = f"the interval's spread is at least the measured one-node -> multi-node error ({SPLIT_NOTE})"
    if not hw.spec.is_gpu:
        return text + (
            f"; {world} ranks is past the {most} its runs measured: {floor}, measured on GPUs (no CPU run measured "
            "how a CPU fit extrapolates: read it as a floor)"
        )
    nodes, spanned = -(-world // node), -(-most // node)
    if spanned > 1:
        return text + f"; {world} GPUs span {nodes} nodes, more than its runs on {spanned} nodes measured: {floor}"
    return text + (
        f"; {world} GPUs span {nodes} nodes, which its one-node runs never measured: {_held_text(info)} are "
        f"{info.hardware}'s (not this stack's), and {floor}"
    )


SPLIT_NOTE = f"shipped.SPLIT_LOG_SD {shipped.SPLIT_LOG_SD:.3f}"


def _held_text(info: StackInfo) -> str:
    """'inter-node links and X, Y' (the links alone when the stack holds no constant)."""
    return "inter-node links" + (f" and {', '.join(info.held)}" if info.held else "")


def _worlds(info: StackInfo) -> str:
    return ", ".join(str(w) for w in info.world_sizes) or "no"


def format_stack_fit(result: StackFit, hw: HardwareProfile) -> str:
    """What a stack calibration fitted (with the values), what it held at the hardware's and why, and its spread."""
    eff, base = result.profile.efficiency, hw.efficiency
    source = hw.stack.name if hw.stack is not None else hw.name  # whose constants the calibration started from
    links = f"and network stay at {source}'s" if source == hw.name else f"stay at {hw.name}'s, network at {source}'s"
    lines = []
    for name in result.fitted:
        if name == "compute":
            factor = eff.matmul / base.matmul
            lines.append(
                f"fitted compute: x{factor:.3f} on {source}'s matmul and attention efficiency -> matmul "
                f"{eff.matmul:.4g}, attention {eff.attention:.4g}"
            )
        elif hasattr(eff, name):
            lines.append(f"fitted {name}: {getattr(base, name):.4g} -> {getattr(eff, name):.4g}")
        else:
            lines.append(f"fitted {name}: {getattr(hw.spec, name):.4g} -> {getattr(result.profile.spec, name):.4g}")
    held = ", ".join(f"{n} {getattr(base, n):.4g}" for n in result.held if n != "compute" and hasattr(base, n))
    info = result.profile.stack
    if held:
        lines.append(f"held at {source}'s: {held}")
    if info is not None and hw.spec.is_gpu and max(info.world_sizes) <= hw.spec.devices_per_node:
        lines.append(
            f"runs on one node (<= {hw.spec.devices_per_node} GPUs): no inter-node constant is identified; the "
            f"inter-node links {links}, and predictions past one node say so"
        )
    lines.append(f"spread (tps_log_sd, the interval's +-1 sd): {eff.tps_log_sd:.4f}{_past_spread(result, hw)}")
    return "\n".join(lines)


def _past_spread(result: StackFit, hw: HardwareProfile) -> str:
    """Where the runs' own spread stops: past their nodes (ranks on a CPU) the interval widens (interval.tps_spread)."""
    info, sd = result.profile.stack, result.profile.efficiency.tps_log_sd
    if info is None or not info.world_sizes:
        return ""
    where = f"{max(info.world_sizes)} ranks" if not hw.spec.is_gpu else "the nodes its runs spanned"
    return f" up to {where}; past them max(it, {SPLIT_NOTE}) = {max(sd, shipped.SPLIT_LOG_SD):.4f}"


def moe_lines(est: Estimate) -> list[str]:
    """MoE flavors: the routed experts' share of the rank's state, active vs total parameters, the load assumed."""
    lay, args = est.layout, layout_args(est.layout)
    if not args.is_moe:
        return []
    numel = routed_rank_numel(args, lay, est.memory.rank)
    counts = param_counts(args)
    held = f"{args.n_routed_experts // lay.ep} of {args.n_routed_experts} experts per layer"
    split = f"1/{lay.efsdp} of each" if lay.ep > 1 else f"1/{lay.fsdp_size} of the experts' rows"
    load = f"busiest EP rank at {MAX_LOAD} x the mean tokens" if lay.ep > 1 else "no EP: every rank runs its own tokens"
    return [
        f"  of which routed experts      {numel * sum(STATE_BYTES.values()) / GIB:8.2f}   ({numel:,} parameters: "
        f"{held}, {split}; weights + grads + Adam)",
        f"  MoE: {counts.active:,} active of {counts.total:,} parameters (compute and MFU count the active); {load}",
    ]


def memory_verdict(est: Estimate, iv: Interval) -> str:
    """'fits', 'DOES NOT FIT' or 'tight' with the margin of the point estimate."""
    if iv.verdict == "fits":
        return f"fits ({iv.usable_gib - iv.memory_high:.1f} GiB to spare at the interval's high end)"
    if iv.verdict == "does not fit":
        return f"DOES NOT FIT (short by {iv.memory_low - iv.usable_gib:.1f} GiB at the interval's low end)"
    margin = iv.usable_gib - est.peak_memory_gib
    return f"tight (margin {margin:+.1f} GiB; the interval {iv.memory_low:.1f} - {iv.memory_high:.1f} straddles it)"


def format_timeline(trace: list[tuple[int, float, float, str]], width: int = 100) -> str:
    """The simulated pipeline step as one line per rank: F forward, B backward, I / W the input- and weight-gradient
    halves of a split backward, '.' waiting (bubble or sends); each column is 1/width of the step."""
    if not trace:
        return "timeline: no pipeline parallel in this layout"
    makespan = max(end for _, _, end, _ in trace)
    ranks = 1 + max(rank for rank, _, _, _ in trace)
    rows = [["."] * width for _ in range(ranks)]
    for rank, start, end, action in sorted(trace, key=lambda t: t[1]):
        kind = action.strip("0123456789")
        first = min(width - 1, int(start / makespan * width))
        last = max(first + 1, round(end / makespan * width))
        rows[rank][first:last] = [kind] * (last - first)
        del rows[rank][width:]
    lines = [f"pipeline step, simulated ({makespan * 1e3:.1f} ms; one column = {makespan / width * 1e3:.2f} ms):"]
    lines += [f"  rank {rank:>3} |{''.join(row)}|" for rank, row in enumerate(rows)]
    return "\n".join(lines)


def _row(label: str, est: Estimate, hw: HardwareProfile) -> str:
    parts = sorted(est.time.items(), key=lambda kv: -kv[1])[1:3]
    overhead = ", ".join(f"{SHORT[k]} {v / est.step_time:.0%}" for k, v in parts if v > 0)
    iv = interval(est, hw)
    return (
        f"| {label} | {est.layout.describe()} | {est.tps_per_device:,.1f} ({iv.tps_low:,.0f}-{iv.tps_high:,.0f}) | "
        f"{est.mfu_pct:.1f} | {est.peak_memory_gib:.1f} ({iv.memory_low:.0f}-{iv.memory_high:.0f}) | "
        f"{iv.verdict} | {overhead} |"
    )


def separation(result: SearchResult, hw: HardwareProfile) -> str:
    """Whether the recommendation and the runner-up are told apart by more than the recommendation's interval."""
    if len(result.ranked) < 2:
        return "no runner-up: the recommendation is the only fitting layout"
    best, second = result.ranked[0], result.ranked[1]
    gap = second.tps_per_device / best.tps_per_device - 1
    sd = difference_sd(best, second, hw)
    if separable(best, second, hw=hw):
        return (
            f"the runner-up is {gap:+.1%} from the recommendation, beyond the +-{sd:.1%} a predicted ratio of two "
            "layouts misses by: separable"
        )
    return (
        f"NOT SEPARABLE: the runner-up is {gap:+.1%} from the recommendation, within the +-{sd:.1%} a predicted ratio "
        "of two layouts misses by (leave-one-out, paired); the model cannot tell them apart, measure both"
    )


def why(winner: Estimate, other: Estimate) -> str:
    """How ``other`` differs from ``winner``: speed, and the step-time parts (per token) that grew or shrank most."""
    if other is winner:
        return "the recommendation"
    rel = other.tps_per_device / winner.tps_per_device - 1
    w_tok, o_tok = winner.layout.tokens_per_device_step, other.layout.tokens_per_device_step
    floor = 0.01 * winner.step_time / w_tok  # ignore parts that move by less than 1 % of the winner's time per token
    keys = winner.time.keys() | other.time.keys()  # the memory levers add their own parts
    deltas = {k: d for k in keys if abs(d := other.time.get(k, 0.0) / o_tok - winner.time.get(k, 0.0) / w_tok) >= floor}
    costs = ", ".join(
        f"{SHORT[k]} +{d * 1e3:.3g}" for d, k in sorted(((d, k) for k, d in deltas.items()), reverse=True)[:2] if d > 0
    )
    saves = ", ".join(f"{SHORT[k]} {d * 1e3:.3g}" for d, k in sorted((d, k) for k, d in deltas.items())[:2] if d < 0)
    text = f"{rel:+.1%}"
    if costs:
        text += f"; costs {costs} ms/token"
    if saves:
        text += f"; saves {saves} ms/token"
    if rel > 0:
        text += (
            f"; not chosen: {complexity(other.layout)} parallel dimensions beyond FSDP vs {complexity(winner.layout)}"
        )
        if not other.fits:
            text += ", does not fit"
    elif not other.fits:
        text += "; does not fit"
    return text


def format_search(result: SearchResult, hw: HardwareProfile) -> str:
    """The recommendation, the runner-up and the config's own layout, then why this TP degree and this schedule."""
    best = result.best
    lay = best.layout
    header = (
        "| | layout | tokens/s/device (+-1 sd) | MFU % | memory GiB (+-1 sd) | memory | largest overheads |\n"
        "|---|---|---:|---:|---:|---|---|"
    )
    lines = [
        f"meshforge plan --search: {lay.flavor} on {lay.world_size} x {hw.name}, global batch "
        f"{lay.local_batch_size * lay.dp} x seq {lay.seq_len}; {result.tried} layouts tried, "
        f"{len(result.ranked)} fit",
        "",
        header,
        _row("recommended", best, hw),
    ]
    if len(result.ranked) > 1:
        lines.append(_row("runner-up", result.ranked[1], hw))
    if result.baseline is not None:
        lines.append(_row("your config", result.baseline, hw))
    lines += [line for line in [explain(best, hw, layout_args(lay))] if line]  # memory levers (plan/physics/levers.py)
    lines += ["", separation(result, hw)]
    lines += [f"not searched: {feature}: {reason}" for feature, reason in result.excluded]
    lines += ["", "why this TP degree (best fitting layout per TP degree):"]
    lines += [f"  TP {e.layout.tp}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})" for e in _sorted(result, "tp")]
    if layout_args(lay).is_moe:
        lines += ["", "why this EP degree (best fitting layout per expert-parallel degree):"]
        lines += [f"  EP {e.layout.ep}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})" for e in _sorted(result, "ep")]
    lines += ["", "why this pipeline schedule (best fitting layout per schedule):"]
    for e in _sorted(result, "schedule"):
        name = e.layout.schedule if e.layout.pp > 1 else "no pipeline"
        lines.append(f"  {name}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})")
    lines += ["", "why this AC mode (best fitting layout per mode):"]
    lines += [
        f"  {e.layout.ac_mode}: {e.tps_per_device:,.1f} tok/s ({why(best, e)})" for e in _sorted(result, "ac_mode")
    ]
    return "\n".join(lines)


def _sorted(result: SearchResult, key: str) -> list[Estimate]:
    return sorted(best_by(result, key), key=lambda e: -e.tps_per_device)


def search_json(result: SearchResult, hw: HardwareProfile) -> dict[str, Any]:
    """The JSON form of a search: the recommendation (top-level keys as for one estimate) and the alternatives, each
    with its interval; whether the first two are separable; what was not searched and why."""
    out = result.best.to_dict() | interval(result.best, hw).as_dict()
    second = result.ranked[1] if len(result.ranked) > 1 else None
    out["runner_up"] = second.to_dict() | interval(second, hw).as_dict() if second else None
    out["separable"] = separable(result.best, second, hw=hw) if second else True
    out["config_layout"] = (
        result.baseline.to_dict() | interval(result.baseline, hw).as_dict() if result.baseline else None
    )
    out["not_searched"] = [{"feature": f, "reason": r} for f, r in result.excluded]
    out["lever"] = explain(result.best, hw, layout_args(result.best.layout)) or None
    out["layouts_tried"], out["layouts_fitting"] = result.tried, len(result.ranked)
    out["best_per_tp"] = [_brief(e) for e in _sorted(result, "tp")]
    out["best_per_schedule"] = [_brief(e) for e in _sorted(result, "schedule")]
    if layout_args(result.best.layout).is_moe:
        out["best_per_ep"] = [_brief(e) for e in _sorted(result, "ep")]
    return out


def _brief(est: Estimate) -> dict[str, Any]:
    return {
        "layout": est.layout.describe(),
        "tps_per_device": round(est.tps_per_device, 2),
        "peak_memory_gib": round(est.peak_memory_gib, 2),
    }


def fit_statistics(time_fit: Fit, mem_fit: MemoryFit | None, start: HardwareProfile) -> dict[str, Any]:
    """Each fitted constant's value, standard error and determining runs; the dropped and merged ones."""
    fitted = time_fit.apply(start)
    out: dict[str, Any] = {
        "constants": [
            {
                "name": c.name,
                "value": _fitted_value(fitted, c),
                "stderr": _fitted_value(fitted, c) * c.log_se,
                "determined_by": list(c.determined_by),
            }
            for c in time_fit.constants
        ],
        "dropped": [{"name": n, "reason": r} for n, r in time_fit.dropped],
        "tps_log_residual_sd": time_fit.residual_sd,
    }
    if mem_fit is not None:
        out["memory"] = {
            "allocator_overhead": mem_fit.allocator_overhead,
            "allocator_overhead_stderr": mem_fit.stderr[0],
            "framework_gib": mem_fit.framework_gib,
            "framework_gib_stderr": mem_fit.stderr[1],
            "relative_residual_sd": mem_fit.residual_sd,
            "merged": mem_fit.merged,
        }
    return out


def _fitted_value(fitted: HardwareProfile, c: fitting.Constant) -> float:
    """A constant's fitted value; a family factor's is its multiplier (on the shared compute efficiencies)."""
    return c.multiplier if c.name.startswith(fitting.FAMILY) else fitting.value(fitted, c.name)


def format_fit_statistics(stats: dict[str, Any]) -> str:
    """The fit's constants as a Markdown table, then what was dropped or merged."""
    lines = ["\n| constant | value | standard error | determined by |", "|---|---:|---:|---|"]
    for c in stats["constants"]:
        lines.append(f"| {c['name']} | {c['value']:.4g} | {c['stderr']:.2g} | {', '.join(c['determined_by'])} |")
    mem = stats.get("memory")
    if mem:
        slack, slack_se = mem["allocator_overhead"], mem["allocator_overhead_stderr"]
        lines.append(f"| allocator_overhead | {slack:.4g} | {slack_se:.2g} | memory rows |")
        lines.append(
            f"| framework_gib | {mem['framework_gib']:.4g} | {mem['framework_gib_stderr']:.2g} | memory rows |"
        )
    lines += [f"dropped {d['name']}: {d['reason']} (held at its start)" for d in stats["dropped"]]
    if mem and mem["merged"]:
        lines.append(mem["merged"])
    return "\n".join(lines)
