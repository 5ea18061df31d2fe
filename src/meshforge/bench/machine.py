"""The machine a sweep ran on and its state: CPU model, cores, clock frequency where readable, load before and during.

A benchmark on a shared machine measures the neighbours too. The load average is read before the sweep starts and
sampled while it runs (a background thread reading /proc/loadavg), and a sweep that started on a busy machine or
whose intervals came out wide says so in its report (``noise_warnings``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from meshforge.bench.stats import NOISY_HALF_WIDTH
from meshforge.threads import Worker

CPUFREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq")


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_mhz(cpuinfo: str) -> list[float]:
    """Current clock of each logical CPU as /proc/cpuinfo reports it (empty where it does not)."""
    return [float(line.split(":", 1)[1]) for line in cpuinfo.splitlines() if line.startswith("cpu MHz")]


def cpufreq(folder: Path = CPUFREQ) -> dict[str, Any]:
    """cpu0's frequency policy (kHz -> MHz) and governor where the kernel exposes cpufreq (VMs often do not)."""
    out: dict[str, Any] = {}
    for key in ("scaling_cur_freq", "scaling_min_freq", "scaling_max_freq", "cpuinfo_max_freq"):
        try:
            out[key.replace("_freq", "_mhz")] = int((folder / key).read_text()) / 1000
        except (OSError, ValueError):
            continue
    with contextlib.suppress(OSError):
        out["governor"] = (folder / "scaling_governor").read_text().strip()
    return out


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, clocks, accelerators, versions, load before the sweep."""
    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    cuda = torch.cuda.is_available()
    mhz = cpu_mhz(cpuinfo)
    return {
        "cpu": cpu_model(cpuinfo),
        "cpu_cores": cpu_cores(),
        "cpu_mhz": [round(m) for m in mhz],
        "cpufreq": cpufreq(),
        "device": "cuda" if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu_name": torch.cuda.get_device_name(0) if cuda else "",
        "backend": "nccl" if cuda else "gloo",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m_before": load_average(),
        "busy_cores_before": busy_cores(),
    }


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, None where it is unreadable."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(seconds: float = 1.0) -> float | None:
    """How many cores other processes keep busy right now (/proc/stat over ``seconds``, before any rank starts).
    Unlike the 1-minute load average it does not still count a sweep that has just ended."""
    first = cpu_times()
    time.sleep(seconds)
    second = cpu_times()
    if first is None or second is None or second[1] <= first[1]:
        return None
    return round((second[0] - first[0]) / (second[1] - first[1]) * cpu_cores(), 2)


class LoadSampler:
    """Samples the 1-minute load average every ``interval_s`` in a daemon thread while the sweep runs; a failure of
    the thread is raised (one line) when the sweep ends and by `summary`."""

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = Worker(self._loop, name="bench-load-sampler", what="the bench's load sampler")

    def _loop(self) -> None:
        while not self._stop.is_set():
            value = load_average()
            if value is not None:
                self.samples.append(value)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        if exc_type is None:  # one line if the sampler failed or does not stop; never hides the sweep's own error
            self._thread.finish(timeout=self.interval_s + 1.0)
        else:
            self._thread.join(timeout=1.0)

    def summary(self) -> dict[str, Any]:
        """min / median / max of the samples so far, and their count (one line if the sampler failed)."""
        self._thread.check()
        values = sorted(self.samples)
        if not values:
            return {"samples": 0}
        return {
            "samples": len(values),
            "min": values[0],
            "median": values[len(values) // 2],
            "max": values[-1],
            "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }


SPEED_DRIFT = 0.05  # a sweep whose machine-speed probes differ by more than this is flagged
BUSY_CORES = 0.5  # other processes using more than half a core before the sweep make it noisy


def speed_probe(seconds: float = 0.3) -> float:
    """The machine's speed now, in GFLOP/s of an fp32 matmul on all its cores (device/peak.py's probe). Taken before
    every repetition round and after the last, it records what the load average cannot: a host that got slower. All
    cores, not one: a virtual machine can lose part of one core to its host while a one-thread probe stays steady."""
    import torch

    from meshforge.device.peak import matmul_probe

    previous = torch.get_num_threads()
    torch.set_num_threads(cpu_cores())
    try:
        return round(matmul_probe(torch.float32, seconds=seconds) / 1e9, 2)
    finally:
        torch.set_num_threads(previous)


def speed_summary(samples: list[float]) -> dict[str, Any]:
    """The probes of one sweep: each value, their median and their spread ((max - min) / median)."""
    if not samples:
        return {}
    median = statistics.median(samples)
    spread = (max(samples) - min(samples)) / median if median else 0.0
    return {
        "probe": f"fp32 matmul, {cpu_cores()} threads",
        "gflops": samples,
        "median": median,
        "spread": round(spread, 4),
    }


def noise_warnings(machine: dict[str, Any], sweep: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """Why this sweep's figures may not be trusted: a busy machine before or during it, or wide intervals."""
    cores = machine.get("cpu_cores") or 1
    warnings = []
    busy = machine.get("busy_cores_before")
    before = machine.get("load_avg_1m_before") if busy is None else None  # old files: the load average alone
    if (busy is not None and busy > BUSY_CORES) or (before is not None and before > cores):
        what = (
            f"{busy:.2f} of {cores} cores busy" if busy is not None else f"load average {before:.2f} on {cores} cores"
        )
        warnings.append(
            f"the machine was busy before the sweep started ({what}): other processes shared the cores the ranks ran on"
        )
    during = (sweep.get("load_avg_1m") or {}).get("max")
    used = max((r.get("world_size", 1) for r in records if r.get("status") == "ok"), default=1)
    if during is not None and during > max(cores, used) + 1:
        warnings.append(
            f"load average reached {during:.2f} during the sweep, above what its own ranks ({used}) and the cores "
            f"({cores}) explain"
        )
    speed = sweep.get("machine_speed") or {}
    if (speed.get("spread") or 0) > SPEED_DRIFT:
        warnings.append(
            f"the machine's own speed moved by {speed['spread']:.0%} during the sweep (matmul probe between "
            f"repetition rounds: {min(speed['gflops']):.1f}-{max(speed['gflops']):.1f} GFLOP/s): differences of that "
            "size are the machine, not the strategies"
        )
    wide = [r["name"] for r in records if (r.get("tps_per_device_ci_half_width") or 0) > NOISY_HALF_WIDTH]
    if wide:
        warnings.append(
            f"{len(wide)} run(s) have a confidence interval wider than +-{NOISY_HALF_WIDTH:.0%} of their median "
            f"({', '.join(wide[:6])}{', ...' if len(wide) > 6 else ''}): rerun them on a quieter machine or with "
            "more --repeat"
        )
    return warnings
