"""Alpha-beta costs of collectives on the link a mesh axis runs over. Pure Python.

Ring algorithms (what NCCL and gloo use for large messages): all-gather and reduce-scatter move (n-1)/n of the full
buffer through every rank's link in n-1 steps; all-reduce is a reduce-scatter plus an all-gather; point-to-point is one
message. The rank grid is arange(world).reshape(pp, dp_replicate, dp_shard, cp, tp) (tp innermost), so an axis whose
ranks, with everything inside it, fit in one host talks over NVLink, otherwise over the inter-node network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout

AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Link:
    """Achieved bus bandwidth (bytes/s) and per-step latency (s) of one axis's collectives."""

    bandwidth: float
    latency: float
    intra_node: bool
    log_steps: bool = False
    """CPU hosts: a collective's latency is log2(n) steps, not the ring's n - 1 (see latency_steps)."""


def axis_link(layout: Layout, axes: tuple[str, ...], hw: HardwareProfile) -> Link:
    """The link the group spanning ``axes`` (adjacent in the grid) uses: NVLink if it stays in one host."""
    sizes = {
        "pp": layout.pp,
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "cp": layout.cp,
        "tp": layout.tp,
    }
    outermost = min(AXIS_ORDER.index(a) for a in axes)
    span = 1
    for axis in AXIS_ORDER[outermost:]:
        span *= sizes[axis]
    spec, eff = hw.spec, hw.efficiency
    cpu = not spec.is_gpu
    # CPU hosts: a step's latency is waiting for a core, which grows with the runnable ranks per core
    wait = spec.oversubscription(layout.world_size, layout.threads_per_rank) if cpu else 1.0
    if span <= spec.devices_per_node:
        return Link(spec.intra_node_bandwidth * eff.network, spec.intra_node_latency * wait, True, cpu)
    return Link(spec.inter_node_bandwidth * eff.network, spec.inter_node_latency * wait, False, cpu)


def latency_steps(n: int, link: Link) -> float:
    """Latency-bound steps of an n-rank all-gather: the ring's n - 1 on GPUs; log2(n) on CPU hosts, where a step's
    cost is the scheduler handing the cores to the next rank (not a wire hop) and the ranks of a group are woken
    together, so it grows like a tree's depth. Measured on the 2-core bench (docs/planner.md, "CPU hosts")."""
    return math.log2(n) if link.log_steps else n - 1


def all_gather(total_bytes: float, n: int, link: Link) -> float:
    """Seconds to all-gather a buffer of ``total_bytes`` (the gathered size) over n ranks."""
    if n <= 1 or total_bytes <= 0:
        return 0.0
    return (n - 1) / n * total_bytes / link.bandwidth + latency_steps(n, link) * link.latency


def reduce_scatter(total_bytes: float, n: int, link: Link) -> float:
    """Seconds to reduce-scatter a buffer of ``total_bytes`` (the unsharded size) over n ranks."""
    return all_gather(total_bytes, n, link)


def all_reduce(total_bytes: float, n: int, link: Link) -> float:
    """Seconds to all-reduce ``total_bytes`` over n ranks (ring: reduce-scatter + all-gather)."""
    return 2 * all_gather(total_bytes, n, link)


def p2p(num_bytes: float, link: Link) -> float:
    """Seconds to send one message to a neighbour. On CPU hosts a link's latency is the wait until all ranks of a
    collective hold a core at once; a pipeline send is a copy to one receiver, whose host work the pipeline's
    per-action overhead counts on the cores (HardwareSpec.stage_overhead), so only the copy remains here."""
    if num_bytes <= 0:
        return 0.0
    return num_bytes / link.bandwidth + (0.0 if link.log_steps else link.latency)


SMOOTH_WIDTH = 0.02
"""Width of the softplus replacing max(0, comm - hidden), as a fraction of comm + hidden: no kink for the fit to sit
on (the Jacobian, standard errors and intervals are a smooth function's). At comm = hidden it credits w ln 2 = 1.4 %
of comm + hidden as exposed; 10 % either side of the kink it differs from the max by 0.014 % of comm + hidden."""


def exposed(comm_s: float, hidden_s: float, width: float = SMOOTH_WIDTH) -> float:
    """max(0, comm_s - hidden_s), smoothed: w log(1 + exp((comm_s - hidden_s) / w)), w = width (comm_s + hidden_s)."""
    w = width * (comm_s + hidden_s)
    if w <= 0:
        return max(0.0, comm_s - hidden_s)
    x = (comm_s - hidden_s) / w
    return comm_s - hidden_s + w * math.log1p(math.exp(-x)) if x > 0 else w * math.log1p(math.exp(x))
