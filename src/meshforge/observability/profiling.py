"""Profiler traces for a window of steps, and memory snapshots.

Window: every ``profile_freq`` steps the last ``profiler_active`` steps up to the multiple of ``profile_freq`` are
traced, after ``profiler_warmup`` warm-up steps (profiled, then discarded). With the defaults (10, warm-up 3, active 1)
steps 7-9 warm up and step 10 is traced into ``<dump_folder>/<save_traces_folder>/iteration_10/rank_R_trace.json``
(Chrome trace format: open it in https://ui.perfetto.dev or chrome://tracing). Trace events ``ProfilerStep#N`` are
numbered by training step. A window that would end after the last step is not profiled; one cut short by an exception
is saved as far as it got.

Memory (``enable_memory_snapshot``), written to ``<dump_folder>/<save_memory_snapshot_folder>/iteration_N/``:
  * CUDA: the caching allocator records every allocation with its stack from the start; a snapshot
    ``rank_R_memory_snapshot.pickle`` is dumped at each window's end (drag it into https://pytorch.org/memory_viz), and
    on ``torch.OutOfMemoryError`` into ``iteration_N_oom/`` before the error propagates.
  * CPU: there is no allocator history, so the profiler records every allocation and free during the window
    (``profile_memory``) and ``rank_R_memory_timeline.png`` plots the bytes allocated since the window began against
    time, with the step boundaries and the peak marked (the events are also in the trace, as ``[memory]``).
    torch's own categorised timeline (``export_memory_timeline``) is not used: it took 9 s per step of the tiny model
    here and over 40 s under FSDP. An out-of-memory on CPU is the kernel's OOM killer, which no process can catch: no
    snapshot then.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from meshforge.config.schema import Profiling
from meshforge.errors import ConfigError

MAX_MEMORY_EVENTS = 100_000


def check_window(cfg: Profiling) -> None:
    """The warm-up and active steps must fit in one period."""
    if cfg.profiler_warmup + cfg.profiler_active > cfg.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup ({cfg.profiler_warmup}) + profiling.profiler_active ({cfg.profiler_active}) "
            f"must be <= profiling.profile_freq ({cfg.profile_freq}); lower them or raise profile_freq"
        )


def window_action(step: int, cfg: Profiling, last_step: int) -> ProfilerAction:
    """What the profiler does during training step ``step`` (1-based)."""
    position = (step - 1) % cfg.profile_freq + 1  # 1 .. profile_freq within the period
    window_end = step - position + cfg.profile_freq
    if step < 1 or window_end > last_step:
        return ProfilerAction.NONE
    first_active = cfg.profile_freq - cfg.profiler_active + 1
    if position >= first_active:
        return ProfilerAction.RECORD_AND_SAVE if position == cfg.profile_freq else ProfilerAction.RECORD
    if position >= first_active - cfg.profiler_warmup:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


@contextlib.contextmanager
def _windows_clear_events() -> Iterator[None]:
    """torch warns that each cycle's events are dropped at its end: that is what a window is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        yield


class StepProfiler:
    """A context manager around the training steps; call ``step(n)`` after training step ``n`` finished."""

    def __init__(
        self, cfg: Profiling, *, dump_folder: str, rank: int, device: torch.device, first_step: int, last_step: int
    ) -> None:
        check_window(cfg)
        self.cfg, self.rank, self.device, self.last_step = cfg, rank, device, last_step
        self.trace_root = Path(dump_folder) / cfg.save_traces_folder
        self.memory_root = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.cuda_history = cfg.enable_memory_snapshot and device.type == "cuda"
        self.cpu_timeline = cfg.enable_memory_snapshot and device.type != "cuda"
        self.current = first_step  # the step running now
        self.written: list[Path] = []
        self.prof: profile | None = None
        if cfg.enable_profiling or self.cpu_timeline:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.prof = profile(
                activities=activities,
                schedule=lambda n: window_action(n, cfg, last_step),
                on_trace_ready=self._on_trace_ready,
                record_shapes=True,
                profile_memory=self.cpu_timeline,
            )
            self.prof.step_num = first_step - 1  # the next step() enters step first_step: numbering by training step

    def __enter__(self) -> StepProfiler:
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS)
        if self.prof is not None:
            self.prof.start()
            self.prof.step()
        return self

    def step(self, step: int) -> None:
        """Training step ``step`` just finished."""
        assert step == self.current, (step, self.current)
        if self.prof is not None:
            with _windows_clear_events():
                self.prof.step()  # may end a window: _on_trace_ready sees self.current == step
        if self.cuda_history and window_action(step, self.cfg, self.last_step) == ProfilerAction.RECORD_AND_SAVE:
            self._dump_cuda_snapshot(f"iteration_{step}")
        self.current = step + 1

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.prof is not None:
            with _windows_clear_events():
                self.prof.stop()  # a window cut short by an exception is saved as far as it got
        if self.cuda_history:
            if isinstance(exc, torch.OutOfMemoryError):
                self._dump_cuda_snapshot(f"iteration_{self.current}_oom")
            torch.cuda.memory._record_memory_history(enabled=None)

    def _on_trace_ready(self, prof: profile) -> None:
        folder = f"iteration_{self.current}"
        if self.cfg.enable_profiling:
            path = self.trace_root / folder / f"rank_{self.rank}_trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            self.written.append(path)
        if self.cpu_timeline:
            path = self.memory_root / folder / f"rank_{self.rank}_memory_timeline.png"
            plot_cpu_memory(prof, path, f"rank {self.rank}, steps up to {self.current}")
            self.written.append(path)

    def _dump_cuda_snapshot(self, folder: str) -> None:
        path = self.memory_root / folder / f"rank_{self.rank}_memory_snapshot.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        self.written.append(path)


def plot_cpu_memory(prof: profile, path: Path, title: str) -> None:
    """Bytes allocated on the CPU since the window began, from the profiler's allocation events, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    cpu = torch.autograd.DeviceType.CPU
    allocs = sorted(
        (e.start_ns(), e.nbytes())  # type: ignore[union-attr]
        for e in events
        if e.name() == "[memory]" and e.device_type() == cpu
    )
    steps = sorted((e.start_ns(), e.name()) for e in events if e.name().startswith("ProfilerStep#"))
    if not allocs:
        raise RuntimeError("the profiler recorded no CPU allocations (was profile_memory on?)")
    t0 = min(allocs[0][0], steps[0][0] if steps else allocs[0][0])
    times = [(t - t0) / 1e6 for t, _ in allocs]  # ms
    live = [b / 2**20 for b in itertools.accumulate(n for _, n in allocs)]  # MiB
    peak = max(range(len(live)), key=live.__getitem__)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(times, live, where="post", linewidth=1)
    for start, name in steps:
        ax.axvline((start - t0) / 1e6, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"step {name.split('#')[1]}", ((start - t0) / 1e6, 0), rotation=90, fontsize=8, va="bottom")
    ax.annotate(f"peak +{live[peak]:.1f} MiB", (times[peak], live[peak]), fontsize=9, ha="left", va="bottom")
    ax.set_xlabel("time in window (ms)")
    ax.set_ylabel("allocated since window start (MiB)")
    ax.set_title(f"CPU memory timeline: {title}")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


@contextlib.contextmanager
def profiling(
    cfg: Profiling, *, dump_folder: str, rank: int, device: torch.device, first_step: int, last_step: int
) -> Iterator[StepProfiler | None]:
    """A running StepProfiler around the steps when profiling or memory snapshots are enabled, else None."""
    if not (cfg.enable_profiling or cfg.enable_memory_snapshot):
        yield None
        return
    profiler = StepProfiler(
        cfg, dump_folder=dump_folder, rank=rank, device=device, first_step=first_step, last_step=last_step
    )
    with profiler:
        yield profiler
