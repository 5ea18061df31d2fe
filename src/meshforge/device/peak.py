"""The peak FLOP/s of one device: the one table of GPU datasheet peaks and the one CPU matmul probe.

Training's MFU (observability/metrics.py) and the planner's CPU hardware profile (plan/hardware.py) both read
their peaks here, so the two never measure differently.

GPUs: dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, keyed by the exact name
``torch.cuda.get_device_name()`` reports. Variants of one chip differ a lot (H100 SXM 989 TFLOP/s, NVL 835, PCIe
756), so names are matched exactly, never by substring; an unknown name has no peak (no MFU) rather than a guess.

CPUs: the best FLOP/s of a square matmul in the run's dtype with the run's thread count, probed once per
(cpu model, dtype, threads) and cached in ``$MESHFORGE_CACHE/cpu_peak.json``, so MFU of every run compares.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from pathlib import Path

import torch

from meshforge.device.dtypes import dtype_name
from meshforge.paths import cache_root

GPU_PEAK_BF16: dict[str, float] = {
    # NVIDIA Hopper (nvidia.com/en-us/data-center/h100, h200: "with sparsity" / 2)
    "NVIDIA H100 80GB HBM3": 989.4e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989.4e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA H800": 989.4e12,  # export variant: same tensor-core rate as H100 SXM
    "NVIDIA H800 PCIe": 756e12,
    # NVIDIA Ampere / Ada
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362.05e12,
    "NVIDIA L4": 121e12,
    # NVIDIA Blackwell (per GPU)
    "NVIDIA B200": 2250e12,
    "NVIDIA GB200": 2500e12,
    # AMD Instinct (amd.com: MI300X 1307.4 dense bf16; MI250X 383 per OAM = two devices of 191.5)
    "AMD Instinct MI300X": 1307.4e12,
    "AMD Instinct MI325X": 1307.4e12,
    "AMD Instinct MI250X/MI250": 191.5e12,
}
"""``torch.cuda.get_device_name()`` -> dense bf16 peak FLOP/s of one device."""

PROBE_SIZE = 512
"""Side of the square matmul the CPU probe times (the size of a small model's linear layers)."""


def gpu_peak_bf16(name: str) -> float | None:
    """The datasheet dense bf16 peak of the GPU called exactly ``name``; None when the table does not know it."""
    return GPU_PEAK_BF16.get(name.strip())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine type."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def matmul_probe(dtype: torch.dtype, size: int = PROBE_SIZE, seconds: float = 0.3) -> float:
    """Best FLOP/s of a square ``size`` matmul in ``dtype`` on this CPU with torch's current threads, after a
    0.1 s warm-up (thread pools and caches start cold)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    warm = time.perf_counter() + 0.1
    while time.perf_counter() < warm:
        a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best


def peak_cache() -> Path:
    """Where the CPU probe's figures are kept."""
    return cache_root() / "cpu_peak.json"


def cached_cpu_peak(dtype: torch.dtype, threads: int | None = None) -> float:
    """The CPU matmul peak for (cpu model, dtype, threads), probed once per machine and cached: a probe taken while
    other ranks start up would measure the load, not the CPU. Ranks take a file lock, so only the first one probes
    (alone) and the others read its figure. ``threads`` None: torch's current thread count."""
    threads = threads or torch.get_num_threads()
    path = peak_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = f"{cpu_model()}|{dtype_name(dtype)}|{threads}"  # the probe is always PROBE_SIZE
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = json.loads(path.read_text()) if path.is_file() else {}
        if key not in table:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                table[key] = matmul_probe(dtype, seconds=1.0)
            finally:
                torch.set_num_threads(previous)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
    return float(table[key])


def faster_cpu_dtype(threads: int | None = None) -> tuple[str, str]:
    """'float32' or 'bfloat16', whichever the (cached) CPU probe finds faster, and a sentence saying why."""
    fp32, bf16 = cached_cpu_peak(torch.float32, threads), cached_cpu_peak(torch.bfloat16, threads)
    name = "bfloat16" if bf16 > fp32 else "float32"
    return name, f"CPU matmul probe: float32 {fp32 / 1e9:.3g} GFLOP/s, bfloat16 {bf16 / 1e9:.3g} GFLOP/s"


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """Peak FLOP/s of one ``device`` for matmuls in ``dtype`` and where the figure comes from (None: unknown)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_bf16(name)
        if peak is None:
            return None, f"no peak known for GPU {name!r} (device/peak.py GPU_PEAK_BF16): MFU not reported"
        return peak, f"{name} dense bf16 peak (datasheet)"
    if device.type != "cpu":
        return None, f"no peak known for device type {device.type!r}: MFU not reported"
    threads = torch.get_num_threads()
    peak = cached_cpu_peak(dtype, threads)
    return peak, f"CPU {dtype_name(dtype)} matmul probe, {threads} thread(s), cached in {peak_cache()}"
