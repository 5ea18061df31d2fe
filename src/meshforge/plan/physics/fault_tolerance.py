"""The planner's view of fault-tolerant replica groups (torchft, train/fault_tolerance.py): what they cost per step
and what they save at scale. `meshforge plan ... --fault-tolerance` prints it; nothing on the prediction path
(plan/physics/estimate.py, search) imports this module.

Step time. Plain HSDP reduces the replicate dimension per block inside FSDP's backward, partly under compute; a
torchft group instead all-reduces its whole gradient shard once after backward through the Manager's own process
group (exposed), and asks the Lighthouse for the quorum and votes on the commit every step. So

    t_ft = t_plain - exposed_fsdp(HSDP) + exposed_fsdp(one group, replicate 1) + all_reduce(gradient shard, R) + q

with the exposed FSDP terms, the gradient bytes per rank and the link of the replicate axis from
plan/physics/estimate.py and plan/physics/comm.py, and ``q`` the quorum + commit time per step (default: measured on the
CPU bench, see QUORUM_SECONDS).

Goodput. Failures arrive at rate N / MTBF-per-GPU (a GPU's MTBF from the Llama 3 paper by default: 419 unexpected
interruptions in 54 days of pre-training on 16,384 H100s, Dubey et al. 2024, "The Llama 3 Herd of Models", sec.
3.3.4). A failure costs, in seconds of the whole job:

    checkpoint-restart:  detect (comm.train_timeout_seconds) + interval / 2 (work since the last checkpoint, on
                         average) + restart (relaunch, load)
    live recovery:       detect (Lighthouse heartbeat) + one step (retried) + recovery (the peer's state over the
                         replicate link) + restart / R (only the lost group, 1 / R of the job, waits for its relaunch)

and goodput (the useful fraction of the job's time) = max(0, 1 - lost x rate) x interval / (interval + save); the
effective tokens/s per device of a mode is its goodput x its fault-free tokens/s (plain: t_plain, live: t_ft). The
checkpoint interval that minimises save + lost work (Young 1974, Daly 2006) is sqrt(2 x save x cluster MTBF).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any

from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout, layout_args
from meshforge.plan.physics import comm
from meshforge.plan.physics.estimate import Estimate, estimate
from meshforge.plan.physics.memory import STATE_BYTES
from meshforge.plan.physics.parts import local_param_numel, rank_parts

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
MTBF_GPU_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS  # 50,677 GPU-hours (~5.8 years) per GPU
QUORUM_SECONDS = 0.021
"""Quorum + commit vote per step: the median (0.0206 s; quartiles 0.013 / 0.038 s; 120 steps) measured on the CPU
bench (configs/bench/fault_tolerance.toml, 2 groups x FSDP 2, AMD EPYC 2 cores, load average ~13, 2026-12-02;
docs/benchmarks/bench-fault-tolerance/); it includes waiting for the slower group. On a cluster: one RPC to the
Lighthouse and one vote among the groups' managers per step; pass --ft-quorum-seconds with a measured figure."""
HEARTBEAT_SECONDS = 2.0
"""The Lighthouse declares a silent group dead after this (`meshforge ft lighthouse --heartbeat-timeout-ms`)."""
GIB = 2**30


@dataclass(frozen=True)
class Failures:
    """What a failure costs and how often one comes (every figure in seconds unless named otherwise)."""

    mtbf_gpu_hours: float = MTBF_GPU_HOURS
    checkpoint_interval_s: float = 1800.0
    checkpoint_save_s: float = 10.0
    restart_s: float = 600.0
    detect_restart_s: float = 100.0
    detect_live_s: float = HEARTBEAT_SECONDS

    def cluster_mtbf_s(self, gpus: int) -> float:
        return self.mtbf_gpu_hours * 3600.0 / gpus


@dataclass(frozen=True)
class StepCost:
    plain_s: float
    ft_s: float
    allreduce_s: float
    hsdp_exposed_s: float
    group_exposed_s: float
    quorum_s: float

    @property
    def slowdown(self) -> float:
        return self.ft_s / self.plain_s - 1


def step_cost(layout: Layout, hw: HardwareProfile, quorum_s: float = QUORUM_SECONDS) -> tuple[StepCost, Estimate]:
    """(the step-time cost of running dp_replicate as torchft groups, the estimate of one group)."""
    if layout.dp_replicate < 2:
        raise ConfigError(
            "--fault-tolerance models torchft replica groups over the replicate dimension: set "
            "--parallelism.data_parallel_replicate_degree R (R >= 2 groups)"
        )
    plain = estimate(layout, hw)
    group = estimate(replace(layout, dp_replicate=1), hw)  # FSDP / TP / PP / CP inside one group, same local batch
    link = comm.axis_link(layout, ("dp_replicate",), hw)
    allreduce = comm.all_reduce(gradient_shard_bytes(layout), layout.dp_replicate, link)
    hsdp, inside = plain.time["exposed_fsdp_comm"], group.time["exposed_fsdp_comm"]
    ft = plain.step_time - hsdp + inside + allreduce + quorum_s
    return StepCost(plain.step_time, ft, allreduce, hsdp, inside, quorum_s), group


def gradient_shard_bytes(layout: Layout) -> float:
    """One rank's sharded fp32 gradients (what torchft's Manager all-reduces across the groups); from the parameter
    count, not the memory peak, which may hold none of them (plan/physics/peak.py)."""
    args = layout_args(layout)
    return local_param_numel(args, layout, rank_parts(args, layout, 0)) * STATE_BYTES["grads"]


def recovery_s(group: Estimate, layout: Layout, hw: HardwareProfile) -> float:
    """A rejoining rank receives its peer's parameters and optimizer state over the replicate link."""
    link = comm.axis_link(layout, ("dp_replicate",), hw)
    return comm.p2p((group.memory.parameters + group.memory.optimizer) * GIB, link)


def lost_checkpoint_restart(f: Failures) -> float:
    """Seconds of the whole job one failure costs under checkpoint-restart."""
    return f.detect_restart_s + f.checkpoint_interval_s / 2 + f.restart_s


def lost_live(f: Failures, groups: int, step_s: float, recover_s: float) -> float:
    """Seconds of the whole job one failure costs under live recovery (only the lost group waits for its restart)."""
    return f.detect_live_s + step_s + recover_s + f.restart_s / groups


def goodput(lost_s: float, mtbf_s: float, f: Failures) -> float:
    """Useful fraction of the job's time, net of the work failures lose and of the checkpoint saves."""
    saving = f.checkpoint_interval_s / (f.checkpoint_interval_s + f.checkpoint_save_s)
    return max(0.0, 1 - lost_s / mtbf_s) * saving


def best_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young / Daly's first-order optimal checkpoint interval."""
    return math.sqrt(2 * save_s * mtbf_s)


def analyse(layout: Layout, hw: HardwareProfile, f: Failures, quorum_s: float = QUORUM_SECONDS) -> dict[str, Any]:
    """Every figure of the printed section (and of --json's "fault_tolerance")."""
    cost, group = step_cost(layout, hw, quorum_s)
    mtbf = f.cluster_mtbf_s(layout.world_size)
    recover = recovery_s(group, layout, hw)
    lost_ckpt = lost_checkpoint_restart(f)
    lost_ft = lost_live(f, layout.dp_replicate, cost.ft_s, recover)
    tokens = layout.tokens_per_device_step
    return {
        "groups": layout.dp_replicate,
        "step_time_plain_s": cost.plain_s,
        "step_time_ft_s": cost.ft_s,
        "step_slowdown": cost.slowdown,
        "ft_allreduce_s": cost.allreduce_s,
        "hsdp_exposed_fsdp_s": cost.hsdp_exposed_s,
        "group_exposed_fsdp_s": cost.group_exposed_s,
        "quorum_s": quorum_s,
        "mtbf_gpu_hours": f.mtbf_gpu_hours,
        "cluster_mtbf_s": mtbf,
        "recovery_s": recover,
        "lost_per_failure_checkpoint_restart_s": lost_ckpt,
        "lost_per_failure_live_s": lost_ft,
        "goodput_checkpoint_restart": goodput(lost_ckpt, mtbf, f),
        "goodput_live": goodput(lost_ft, mtbf, f),
        "effective_tps_checkpoint_restart": goodput(lost_ckpt, mtbf, f) * tokens / cost.plain_s,
        "effective_tps_live": goodput(lost_ft, mtbf, f) * tokens / cost.ft_s,
        "best_checkpoint_interval_s": best_interval_s(f.checkpoint_save_s, mtbf),
        "assumptions": vars(f),
    }


def format_section(a: dict[str, Any]) -> str:
    f = a["assumptions"]
    hours = a["cluster_mtbf_s"] / 3600
    return "\n".join(
        [
            f"\nFault tolerance: dp_replicate {a['groups']} as torchft replica groups "
            "(plan/physics/fault_tolerance.py)",
            f"  step time: plain HSDP {a['step_time_plain_s']:.4g} s, fault-tolerant {a['step_time_ft_s']:.4g} s "
            f"({a['step_slowdown']:+.1%}): the replicate all-reduce through the Manager {a['ft_allreduce_s']:.3g} s "
            f"exposed (HSDP's FSDP+replicate comm exposed {a['hsdp_exposed_fsdp_s']:.3g} s, one group's "
            f"{a['group_exposed_fsdp_s']:.3g} s), quorum + commit {a['quorum_s']:.3g} s",
            f"  failures: MTBF {f['mtbf_gpu_hours']:,.0f} GPU-hours per GPU (default: Llama 3, 419 interruptions in "
            f"54 days on 16,384 GPUs) -> one every {hours:.3g} h on this job",
            f"  lost per failure: checkpoint-restart {a['lost_per_failure_checkpoint_restart_s']:,.0f} s (detect "
            f"{f['detect_restart_s']:g} + half the {f['checkpoint_interval_s']:g} s interval + restart "
            f"{f['restart_s']:g}); live recovery {a['lost_per_failure_live_s']:,.1f} s (heartbeat "
            f"{f['detect_live_s']:g} + the retried step + peer transfer {a['recovery_s']:.3g} + restart / "
            f"{a['groups']})",
            f"  goodput: checkpoint-restart {a['goodput_checkpoint_restart']:.1%}, live recovery "
            f"{a['goodput_live']:.1%}; effective tokens/s per device (goodput x fault-free speed): "
            f"{a['effective_tps_checkpoint_restart']:,.1f} vs {a['effective_tps_live']:,.1f} ({versus(a)})",
            f"  checkpoint every {a['best_checkpoint_interval_s']:,.0f} s minimises saves + lost work for a "
            f"{f['checkpoint_save_s']:g} s save (Young / Daly)",
        ]
    )


def versus(a: dict[str, Any]) -> str:
    """Live recovery's effective speed against checkpoint-restart's, which may be none (failures lose more work
    than comes between them)."""
    ckpt, live = a["effective_tps_checkpoint_restart"], a["effective_tps_live"]
    if not ckpt:
        return "checkpoint-restart makes no progress: a failure loses more than the time between failures"
    return f"{live / ckpt - 1:+.1%} with live recovery"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --fault-tolerance flags (grouped, so plan/cli.py only calls this); None: not given (``FLAGS`` defaults)."""
    g = parser.add_argument_group("fault tolerance (--fault-tolerance)")
    g.add_argument("--fault-tolerance", action="store_true", help="torchft groups: step cost and goodput at scale")
    for name, (default, _, text) in FLAGS.items():
        g.add_argument(f"--ft-{name.replace('_', '-')}", type=float, default=None, help=f"{text} (default {default:g})")


FLAGS = {
    "mtbf_gpu_hours": (MTBF_GPU_HOURS, "> 0", "MTBF of one GPU in hours (Llama 3's)"),
    "restart_seconds": (600.0, "> 0", "relaunch + load of a restarted job"),
    "checkpoint_save_seconds": (10.0, ">= 0", "blocking time of one save"),
    "checkpoint_interval_seconds": (
        0.0,
        ">= 0",
        "0: checkpoint.interval_seconds, else checkpoint.interval steps x the plain step time",
    ),
    "quorum_seconds": (QUORUM_SECONDS, ">= 0", "quorum + commit per step"),
}
"""flag (--ft-NAME with dashes) -> (default, the bound it must meet, help)."""
LARGEST = 1e9
"""No --ft-* figure above this (hours or seconds): beyond it the job's figures overflow or mean nothing."""


def check_flags(opts: argparse.Namespace) -> dict[str, float]:
    """Each --ft-* figure (its default when not given), or a one-line ConfigError naming the flag, the value and the
    bound: not a number, infinite, negative, zero where it must be positive, above LARGEST, or given without
    --fault-tolerance (it would change nothing)."""
    given = [name for name in FLAGS if getattr(opts, f"ft_{name}", None) is not None]
    if given and not opts.fault_tolerance:
        flag = f"--ft-{given[0].replace('_', '-')}"
        raise ConfigError(f"{flag} only acts with --fault-tolerance: add --fault-tolerance or drop {flag}")
    values = {}
    for name, (default, least, _) in FLAGS.items():
        value = getattr(opts, f"ft_{name}", None)
        value = default if value is None else value
        low = not value > 0 if least == "> 0" else not value >= 0  # nan fails both
        if low or not math.isfinite(value) or value > LARGEST:
            raise ConfigError(f"--ft-{name.replace('_', '-')} {value} must be a finite number {least} (at most 1e9)")
        values[name] = value
    return values


def check_groups(cfg: JobConfig, layout: Layout) -> None:
    """The [fault_tolerance] keys given beside --fault-tolerance must agree with its R = dp_replicate groups."""
    ft, groups = cfg.fault_tolerance, layout.dp_replicate
    for key in ("group_size", "local_replicas"):
        value = getattr(ft, key)
        if value and value != groups:
            raise ConfigError(
                f"fault_tolerance.{key} = {value} disagrees with --parallelism.data_parallel_replicate_degree "
                f"{groups}: the planner runs the replicate dimension as the groups; drop it or give both the same"
            )
    if not 1 <= ft.min_replica_size <= groups:
        raise ConfigError(
            f"fault_tolerance.min_replica_size = {ft.min_replica_size} must be in [1, {groups}] (the "
            f"data_parallel_replicate_degree groups): no quorum could commit a step otherwise"
        )


def check_failures(f: Failures, gpus: int) -> None:
    """Refuse failures that come faster than a restart: checkpoint-restart would never train (one line)."""
    mtbf = f.cluster_mtbf_s(gpus)
    if mtbf <= f.restart_s:
        raise ConfigError(
            f"--ft-mtbf-gpu-hours {f.mtbf_gpu_hours:g} on {gpus} GPUs is one failure every {mtbf:.3g} s, no longer "
            f"than a restart (--ft-restart-seconds {f.restart_s:g}): the job would never train; the MTBF is per GPU, "
            "in hours (default: Llama 3's, 50,677)"
        )


def run(opts: argparse.Namespace, cfg: JobConfig, layout: Layout, hw: HardwareProfile) -> dict[str, Any]:
    """The analysis for the job's config and the flags (plan/cli.py prints it or adds it to --json)."""
    flags = check_flags(opts)
    check_groups(cfg, layout)
    interval = flags["checkpoint_interval_seconds"] or cfg.checkpoint.interval_seconds
    if not interval:
        interval = cfg.checkpoint.interval * step_cost(layout, hw, flags["quorum_seconds"])[0].plain_s
    f = Failures(
        mtbf_gpu_hours=flags["mtbf_gpu_hours"],
        checkpoint_interval_s=interval,
        checkpoint_save_s=flags["checkpoint_save_seconds"],
        restart_s=flags["restart_seconds"],
        detect_restart_s=float(cfg.comm.train_timeout_seconds),
    )
    check_failures(f, layout.world_size)
    return analyse(layout, hw, f, flags["quorum_seconds"])
