"""Hardware profiles: datasheet figures of a device and its links, plus the few efficiency constants of the model.

A profile = ``HardwareSpec`` (what the vendor states, or what the CPU probe measures) + ``Efficiency`` (what fraction of
it training kernels reach, fitted to every published row of plan/accuracy/published.py; see docs/planner.md). Presets
live in ``PRESETS``; ``load_hardware`` also reads a TOML file with the same keys (configs/hardware/example.toml), and
``save_profile`` writes one (what ``meshforge plan --calibrate`` produces).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshforge.config.io import TOMLI_W_INSTALL, ConfigError, read_data
from meshforge.device.memory_budget import RUNTIME_GIB
from meshforge.errors import optional_import
from meshforge.plan import shipped

GIB = 1024**3


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet figures that training reaches: few, named, each documented in docs/planner.md.

    The GPU defaults are the h100-96gb family's fit to every published row (plan/shipped.py, by plan/accuracy/loo.py;
    rounded); ``family_efficiency`` gives another generation's. tests/unit/test_plan_validate.py fails when a change
    to the physics is not followed by a refit."""

    matmul: float = shipped.REFERENCE["matmul"]
    """Large bf16 GEMMs (the linear layers), as a fraction of the derated peak."""
    attention: float = shipped.REFERENCE["attention"]
    """Flash attention (SDPA) forward/backward, as a fraction of the derated bf16 peak (FA2 on H100: ~0.3-0.4)."""
    float8_speedup: float = shipped.REFERENCE["float8_speedup"]
    """Realised speedup of Float8 linear layers over bf16 (casts and amax included; the hardware bound is 2)."""
    memory_bandwidth: float = shipped.REFERENCE["memory_bandwidth"]
    """Element-wise kernels (norms, RoPE, SwiGLU, loss, optimizer) as a fraction of the memory bandwidth."""
    network: float = shipped.REFERENCE["network"]
    """Collective bus bandwidth as a fraction of the link bandwidth (nccl-tests on NVLink 4 / 400G RDMA: ~0.8)."""
    async_tp_overlap: float = shipped.REFERENCE["async_tp_overlap"]
    """Fraction of tensor-parallel communication async TP (micro-pipelined matmuls) hides, credited only to
    implementations a measurement confirms (estimate.ASYNC_TP_CONFIRMED: TorchTitan's). The published rows do not
    identify it (log standard error > 1), so the fit holds it at this earlier value."""
    allocator_overhead: float = shipped.REFERENCE["allocator_overhead"]
    """Caching-allocator slack: reserved / allocated - 1 at the peak (fragmentation, per-stream pools). The published
    rows cannot tell it from a fixed overhead (estimates correlated -0.99), so it carries both."""
    framework_gib: float = shipped.REFERENCE["framework_gib"]
    """Fixed memory inside the peak reading: workspaces, compile/Float8 scratch (GPU); interpreter + libraries (CPU).
    Merged into allocator_overhead for the GPU presets (see there)."""
    tps_log_sd: float = shipped.REFERENCE["tps_log_sd"]
    """Spread of this profile's tokens/s predictions: RMS of log(predicted / measured) over the leave-one-out
    predictions of the rows it was fitted to (plan/accuracy/loo.py); the interval is +-1 of it."""
    memory_log_sd: float = shipped.REFERENCE["memory_log_sd"]
    """The same spread for the peak memory."""


@dataclass(frozen=True)
class HardwareSpec:
    """One device and its links (per device, one direction, bytes/s; FLOP/s dense)."""

    name: str
    description: str
    peak_bf16_flops: float
    peak_fp32_flops: float
    peak_fp8_flops: float
    memory_gib: float
    """Memory a process can see on one device."""
    memory_bandwidth: float
    """HBM (or DRAM) bandwidth in bytes/s."""
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    devices_per_node: int
    clock_derate: float = 1.0
    """Sustained / boost clock under the power limit; multiplies every peak (not used for MFU, which is nominal)."""
    runtime_gib: float = RUNTIME_GIB
    """Memory outside the peak reading that still counts for 'fits' (CUDA context, NCCL buffers): the reserve training's
    regather auto budgets too (device/memory_budget.py)."""
    node_cores: int = 0
    """CPU hosts: cores the ranks of a node share (0 = each device is its own). With more rank threads than cores,
    compute and memory bandwidth are divided among them, and memory always is."""
    probe_threads: int = 1
    """Threads the probe ran with (node_cores > 0): the peaks above are for that many threads."""
    comm_overlaps_compute: bool = True
    """GPUs run collectives on their own engines beside compute; CPU ranks spend the same cores on gloo."""
    is_gpu: bool = True
    stage_overhead: float = 0.0
    """Host seconds per pipeline action (a stage's forward, backward, or either half of a split backward) besides its
    work: the schedule runtime and one autograd traversal. Hidden behind queued kernels on GPUs; ~1 ms on CPU hosts."""

    def thread_scale(self, threads_per_rank: int = 0) -> float:
        """Multiplier on the probed peaks for one rank running alone: its threads over the probe's (1 on GPUs)."""
        if not self.node_cores:
            return 1.0
        return (threads_per_rank or self.probe_threads) / self.probe_threads

    def oversubscription(self, world_size: int, threads_per_rank: int = 0, busy: float = 1.0) -> float:
        """How many times the runnable rank threads outnumber the node's cores (>= 1; 1 on GPUs), each rank
        counted for the ``busy`` share of the step it computes (a rank blocked in a pipeline bubble sleeps)."""
        if not self.node_cores:
            return 1.0
        ranks = min(world_size, self.devices_per_node)
        return max(1.0, ranks * busy * (threads_per_rank or self.probe_threads) / self.node_cores)

    def device_memory_gib(self, world_size: int) -> float:
        """Memory one rank may use: the device's, or its share of the host's on CPU."""
        return self.memory_gib / min(world_size, self.devices_per_node) if self.node_cores else self.memory_gib


@dataclass(frozen=True)
class StackInfo:
    """What a stack profile's efficiency constants rest on (plan/accuracy/stack.py): the runs' world sizes and
    sources, which constants they determined and which stay at ``hardware``'s (the shipped TorchTitan fit's)."""

    name: str
    hardware: str
    fitted: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    world_sizes: tuple[int, ...] = ()
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class HardwareProfile:
    """A device (its datasheet: ``spec``) with the efficiency constants an implementation reaches on it; ``stack``
    names that implementation's calibration where the profile is a stack profile (plan/accuracy/stack.py)."""

    spec: HardwareSpec
    efficiency: Efficiency = field(default_factory=Efficiency)
    stack: StackInfo | None = None

    @property
    def name(self) -> str:
        return self.spec.name


_H100_SXM = HardwareSpec(
    name="h100",
    description="NVIDIA H100 SXM5 80 GB HBM3, 700 W, NVLink 4 inside 8-GPU hosts, 400 Gb/s RDMA per GPU",
    peak_bf16_flops=989.4e12,
    peak_fp32_flops=66.9e12,
    peak_fp8_flops=1978.9e12,
    memory_gib=79.6,
    memory_bandwidth=3.35e12,
    intra_node_bandwidth=450e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=15e-6,
    devices_per_node=8,
)

PRESETS: dict[str, HardwareSpec] = {
    "h100": _H100_SXM,
    # The article's Grand Teton hosts. The report says the 500 W part's true peak lies between the SXM (989 TFLOP/s)
    # and the NVL (835 TFLOP/s) figures; we take the midpoint: clock_derate = 912 / 989 = 0.92.
    "h100-96gb": replace(
        _H100_SXM,
        name="h100-96gb",
        description="NVIDIA H100 96 GB HBM2e at 500 W (Grand Teton): NVLink inside 8-GPU hosts, 400 Gb/s RDMA per GPU",
        memory_gib=94.5,
        memory_bandwidth=2.4e12,
        clock_derate=0.92,
    ),
    "h200": replace(
        _H100_SXM,
        name="h200",
        description="NVIDIA H200 SXM 141 GB HBM3e, 700 W, NVLink 4, 400 Gb/s RDMA per GPU",
        memory_gib=140.4,
        memory_bandwidth=4.8e12,
    ),
    "a100": HardwareSpec(
        name="a100",
        description="NVIDIA A100 SXM4 80 GB, NVLink 3 inside 8-GPU hosts, 200 Gb/s RDMA per GPU (no Float8)",
        peak_bf16_flops=312e12,
        peak_fp32_flops=19.5e12,
        peak_fp8_flops=0.0,
        memory_gib=79.2,
        memory_bandwidth=2.04e12,
        intra_node_bandwidth=300e9,
        intra_node_latency=5e-6,
        inter_node_bandwidth=25e9,
        inter_node_latency=15e-6,
        devices_per_node=8,
    ),
    "b200": HardwareSpec(
        name="b200",
        description="NVIDIA B200 180 GB HBM3e, 1000 W, NVLink 5 inside 8-GPU hosts, 400 Gb/s RDMA per GPU",
        peak_bf16_flops=2250e12,
        peak_fp32_flops=75e12,
        peak_fp8_flops=4500e12,
        memory_gib=178.4,
        memory_bandwidth=8.0e12,
        intra_node_bandwidth=900e9,
        intra_node_latency=5e-6,
        inter_node_bandwidth=50e9,
        inter_node_latency=15e-6,
        devices_per_node=8,
    ),
    # NVIDIA GB200 NVL72 datasheet (per GPU of 72: 360 / 720 PFLOP/s sparse BF16 / FP8 -> 2.5 / 5 dense, 13.4 TB
    # HBM3e, 576 TB/s, 130 TB/s NVLink): no published row, a stated prior (the shared constants, a wider interval).
    "gb200": HardwareSpec(
        name="gb200",
        description="NVIDIA GB200 NVL72: 186 GB HBM3e, NVLink 5 across the 72-GPU domain, 400 Gb/s RDMA per GPU",
        peak_bf16_flops=2500e12,
        peak_fp32_flops=80e12,
        peak_fp8_flops=5000e12,
        memory_gib=173.4,
        memory_bandwidth=8.0e12,
        intra_node_bandwidth=900e9,
        intra_node_latency=5e-6,
        inter_node_bandwidth=50e9,
        inter_node_latency=15e-6,
        devices_per_node=72,
    ),
}

# CPU: ranks are processes on one host; gloo moves tensors through loopback TCP. Assumed orders of magnitude, ~1 GB/s
# per direction and ~100 us per message; `meshforge plan --calibrate` refits both (docs/planner.md).
CPU_GLOO_BANDWIDTH = 1.0e9
CPU_GLOO_LATENCY = 100e-6
CPU_STAGE_OVERHEAD = 1e-3
"""Starting value, fitted by calibration: on the 2-core bench host a split backward (a second autograd pass) of two
debugmodel blocks at seq 128 costs 4-6 ms more than one full backward (scripts/probe_stage_overhead.py); gloo's
loopback sends and the schedule's Python add host work to every action (docs/planner.md, "Hardware")."""
# Starting values for --calibrate on CPU hosts (rough guesses relative to the probe; nothing published to fit them to).
CPU_EFFICIENCY = Efficiency(
    matmul=0.8,
    attention=0.5,
    float8_speedup=1.0,
    memory_bandwidth=0.5,
    network=1.0,
    async_tp_overlap=0.0,
    allocator_overhead=0.0,
    framework_gib=0.35,
    tps_log_sd=0.25,  # until --calibrate measures its leave-one-out spread
    memory_log_sd=0.25,
)


def family_efficiency(name: str) -> Efficiency:
    """A GPU preset's constants: the shared ones times its family's speed factor on matmul and attention, with its
    own leave-one-out spreads, where published rows determine them (plan/shipped.py FAMILIES); the shared ones with a
    wider spread (the family prior added) for a generation no row measured; the shared ones for the reference."""
    base = Efficiency()
    if name in shipped.FAMILIES:
        f = shipped.FAMILIES[name]
        return replace(
            base,
            matmul=base.matmul * f["factor"],
            attention=base.attention * f["factor"],
            tps_log_sd=f["tps_log_sd"],
            memory_log_sd=f["memory_log_sd"],
        )
    if name in shipped.UNSEEN_PRESETS:
        return replace(base, **shipped.UNSEEN)
    return base


def preset_names() -> list[str]:
    return [*PRESETS, "cpu"]


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A preset by name (``cpu`` runs the probe), or a TOML profile file; ConfigError otherwise."""
    if name_or_path == "cpu":
        return HardwareProfile(cpu_spec(), CPU_EFFICIENCY)
    if name_or_path in PRESETS:
        return HardwareProfile(PRESETS[name_or_path], family_efficiency(name_or_path))
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") or path.is_file():
        return read_profile(path)
    raise ConfigError(
        f"--hardware {name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor a TOML file "
        "(see configs/hardware/example.toml)"
    )


def read_profile(path: Path) -> HardwareProfile:
    """A profile from TOML: a [hardware] table (HardwareSpec keys, or base = a preset) and an optional [efficiency]."""
    tree = read_data(path, "--hardware")
    unknown = sorted(set(tree) - {"hardware", "efficiency"})
    if unknown:
        raise ConfigError(f"--hardware {path}: unknown table or key {unknown[0]!r}; allowed: [hardware], [efficiency]")
    for table in ("hardware", "efficiency"):
        if not isinstance(tree.get(table, {}), dict):
            raise ConfigError(f"--hardware {path}: {table} = {tree[table]!r} must be a table ([{table}] with keys)")
    hw = dict(tree.get("hardware", {}))
    base_name = hw.pop("base", None)
    if base_name is not None and not isinstance(base_name, str):
        raise ConfigError(f"--hardware {path} [hardware]: base = {base_name!r} must be a preset's name, e.g. 'h100'")
    base_profile = load_hardware(base_name) if base_name else None
    spec = _build(HardwareSpec, hw, f"{path} [hardware]", base_profile.spec if base_profile else None)
    base_eff = base_profile.efficiency if base_profile else Efficiency()
    eff = _build(Efficiency, dict(tree.get("efficiency", {})), f"{path} [efficiency]", base_eff)
    return HardwareProfile(spec, eff)


_TOML_TYPES: dict[str, Any] = {"float": (int, float), "int": int, "bool": bool, "str": str}


def _build(cls: type, values: dict[str, Any], where: str, base: Any | None) -> Any:
    """A frozen dataclass from TOML values (on top of ``base``), naming unknown or missing keys."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(names)}")
    for key, value in values.items():
        expected = _TOML_TYPES[str(names[key].type)]
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{where}: {key} = {value!r} must be {names[key].type}")
        if expected == (int, float):
            values[key] = float(value)
    for key, value in values.items():
        _check_range(key, value, where)
    if base is not None:
        built = replace(base, **values)
    else:
        missing = [n for n, f in names.items() if f.default is dataclasses.MISSING and n not in values]
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)} (or give base = a preset name)")
        built = cls(**values)
    if isinstance(built, HardwareSpec) and not built.runtime_gib < built.memory_gib:
        raise ConfigError(
            f"{where}: runtime_gib = {built.runtime_gib:g} leaves nothing of memory_gib = {built.memory_gib:g}: "
            "runtime_gib must be below memory_gib"
        )
    return built


_FRACTION = (0.0, 1.0, True)  # a share of a datasheet figure: (0, 1]
RANGES: dict[str, tuple[float, float, bool]] = {
    **dict.fromkeys(["peak_bf16_flops", "peak_fp32_flops", "memory_gib"], (0.0, math.inf, True)),  # peak_fp8: 0 = none
    **dict.fromkeys(["memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"], (0.0, math.inf, True)),
    "devices_per_node": (1, math.inf, False),
    "probe_threads": (1, math.inf, False),
    "clock_derate": _FRACTION,
    **dict.fromkeys(["matmul", "attention", "network"], _FRACTION),
    "float8_speedup": (1.0, 2.0, False),  # the hardware bound: Float8 at most doubles a bf16 matmul
    "async_tp_overlap": (0.0, 1.0, False),
}
"""(lowest, highest, lowest excluded) of a profile's numbers; every other number must be >= 0. All must be finite.
Efficiency's memory_bandwidth shares the HardwareSpec key's name: > 0 covers both (the fraction is also <= 1)."""


def _check_range(key: str, value: Any, where: str) -> None:
    """A one-line ConfigError naming a non-finite or impossible number of a hardware profile."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {key} = {value} must be a finite number")
    low, high, low_open = RANGES.get(key, (0.0, math.inf, False))
    if "[efficiency]" in where and key == "memory_bandwidth":
        low, high, low_open = _FRACTION
    if value < low or (low_open and value == low) or value > high:
        bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        raise ConfigError(f"{where}: {key} = {value!r} is impossible: it must be {bound}")


def save_profile(profile: HardwareProfile, path: Path) -> None:
    """Write a profile as TOML that ``load_hardware(path)`` reads back."""
    tree = {"hardware": dataclasses.asdict(profile.spec), "efficiency": dataclasses.asdict(profile.efficiency)}
    tomli_w = optional_import("tomli_w", f"writing the hardware profile {path}", TOMLI_W_INSTALL)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# meshforge hardware profile (meshforge plan --hardware THIS_FILE)\n" + tomli_w.dumps(tree))


@functools.lru_cache(maxsize=1)
def cpu_spec() -> HardwareSpec:
    """This host, measured: the matmul probe training's MFU uses (device/peak.py, cached per CPU model, dtype and
    threads), a copy probe with the threads torch uses, memory from /proc/meminfo."""
    import torch

    from meshforge.device.peak import cached_cpu_peak

    threads = torch.get_num_threads()
    return HardwareSpec(
        name="cpu",
        description=f"this host: {os.cpu_count()} cores, probed with {threads} torch thread(s); gloo over loopback",
        peak_bf16_flops=cached_cpu_peak(torch.bfloat16, threads),
        peak_fp32_flops=cached_cpu_peak(torch.float32, threads),
        peak_fp8_flops=0.0,
        memory_gib=_meminfo_gib(),
        memory_bandwidth=_copy_bandwidth(),
        intra_node_bandwidth=CPU_GLOO_BANDWIDTH,
        intra_node_latency=CPU_GLOO_LATENCY,
        inter_node_bandwidth=CPU_GLOO_BANDWIDTH,
        inter_node_latency=CPU_GLOO_LATENCY,
        devices_per_node=1024,
        runtime_gib=0.0,
        node_cores=_cores(),
        probe_threads=threads,
        comm_overlaps_compute=False,
        is_gpu=False,
        stage_overhead=CPU_STAGE_OVERHEAD,
    )


def auto_param_dtype(spec: HardwareSpec) -> str:
    """What ``training.mixed_precision_param = auto`` resolves to on this hardware (device/precision.py's rule):
    bfloat16 on GPUs; on a CPU the dtype its probe found faster."""
    if spec.is_gpu or spec.peak_bf16_flops > spec.peak_fp32_flops:
        return "bfloat16"
    return "float32"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _copy_bandwidth(numel: int = 8 * 1024 * 1024, repeats: int = 5) -> float:
    import time

    import torch

    src = torch.ones(numel)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - start))
    return best


def _meminfo_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return 16.0
