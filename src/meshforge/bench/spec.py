"""A benchmark matrix as data: its runs (BenchRun: a layout, feature flags, how it reads the global batch), the
matrix (BenchMatrix: the shared job, the runs, the scaling series) and the `meshforge train` command line of each run.
Reading and checking a matrix file is bench/matrix.py's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from meshforge.bench.ranks import oversubscribed


@dataclass(frozen=True)
class BenchRun:
    """One strategy: a layout, feature flags, and how it reads the global batch."""

    name: str
    ranks: int
    label: str = ""
    group: str = "strategy"
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: str = "1F1B"
    compile: bool = False
    float8: bool = False
    ac_mode: str = ""
    async_tp: bool = False
    seq_len: int = 0
    global_batch_size: int = 0
    gradient_accumulation_steps: int = 1
    timeout_s: int = 0
    parity_rtol: float = 0.0
    reference: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)
    cpu_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra train keys used only when no CUDA device is present (e.g. emulated Float8 matmuls on a CPU)."""
    fault_tolerance: bool = False
    """Run the dp_replicate dimension as that many torchft replica groups on one machine (bench/ft_rows.py)."""
    auto: bool = False
    """The planner picks the layout (bench/auto_rows.py, as `train --parallelism.auto`); resolved before the sweep."""

    @property
    def resolved_dp_shard(self) -> int:
        return self.dp_shard if self.dp_shard != -1 else self.ranks // (self.dp_replicate * self.tp * self.pp * self.cp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different sequences."""
        return self.dp_replicate * self.resolved_dp_shard

    def layout(self) -> dict[str, Any]:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.resolved_dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "schedule": self.schedule if self.pp > 1 else None,
        }

    def describe(self) -> str:
        """A short human label: 'FSDP 2 x TP 2 + compile'."""
        if self.label:
            return self.label
        parts = [f"{axis} {deg}" for axis, deg in self._axes() if deg > 1] or ["single rank"]
        text = " x ".join(parts)
        if self.pp > 1:
            text += f" ({self.schedule})"
        float8 = "Float8 (emulated)" if self.overrides.get("quantize.dense.float8.emulate") else "Float8"
        for flag, on in (("compile", self.compile), (float8, self.float8), ("async TP", self.async_tp)):
            text += f" + {flag}" if on else ""
        chunks = int(self.overrides.get("training.loss_chunks", 1))
        levers = [f"chunked loss {chunks}"] if chunks > 1 else []
        levers += ["activation offload"] if self.overrides.get("activation_checkpoint.offload") else []
        levers += ["CPU offload"] if self.overrides.get("training.enable_cpu_offload") else []
        return text + "".join(f" + {lever}" for lever in levers)

    def _axes(self) -> list[tuple[str, int]]:
        shard = "FSDP" if self.dp_replicate == 1 else "shard"
        return [
            ("replicate (torchft groups)" if self.fault_tolerance else "replicate", self.dp_replicate),
            (shard, self.resolved_dp_shard),
            ("TP", self.tp),
            ("PP", self.pp),
            ("CP", self.cp),
        ]


@dataclass(frozen=True)
class BenchMatrix:
    """The whole benchmark: shared settings, the runs in order, the scaling series."""

    name: str
    flavor: str
    seq_len: int
    global_batch_size: int
    warmup_steps: int
    measured_steps: int
    runs: list[BenchRun]
    description: str = ""
    config: str = ""
    dtype: str = "float32"
    ac_mode: str = "none"
    timeout_s: int = 300
    threads_per_rank: int = 1
    baseline: str = ""
    parity_rtol: float = 1e-4
    note: str = ""
    repeat: int = 3
    """Repetitions of every run (each its own job), interleaved across runs; `--repeat N` overrides it."""
    confidence: float = 0.95
    """Confidence level of the intervals and of the ranking's "separable"."""
    max_repeat: int = 0
    """Sequential rule (bench/schedule.py): past `repeat`, a run is repeated until its interval is within
    +-target_half_width, up to this many repetitions (0: exactly `repeat`)."""
    target_half_width: float = 0.05
    time_budget_s: float = 0.0
    """A repetition past the minimum starts only if the sweep's time so far plus its length fits (0: no budget)."""
    oversubscribed_repeat: int = 0
    """Repetitions of a run with more ranks than cores (0: `repeat`): it proves parity and memory, not speed."""
    ranked_ranks: int = 0
    """Ranks of the ranked comparison, what `ranks = 0` means (0: detected, bench/ranks.py)."""
    max_ranked_ranks: int = 0
    cores: int = 0
    """CPU cores the ranks may use (0: detected; 0 on GPUs: one rank per GPU, never oversubscribed)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    scaling: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.measured_steps

    def oversubscribed(self, run: BenchRun) -> bool:
        return oversubscribed(run.ranks, self.cores)

    def run(self, name: str) -> BenchRun:
        for run in self.runs:
            if run.name == name:
                return run
        raise KeyError(name)

    def seq_len_of(self, run: BenchRun) -> int:
        return run.seq_len or self.seq_len

    def local_batch_size(self, run: BenchRun) -> int:
        return self.global_batch_of(run) // (run.dp * run.gradient_accumulation_steps)

    def global_batch_of(self, run: BenchRun) -> int:
        """Sequences per optimizer step: the matrix's, unless a run sets its own (e.g. fixed tokens per step)."""
        return run.global_batch_size or self.global_batch_size

    def flags_of(self, run: BenchRun) -> dict[str, Any]:
        """The run's features as results.json records them (the planner's --calibrate reads these)."""
        keys = {**self.overrides, **run.overrides}
        return {
            "compile": run.compile,
            "float8": run.float8,
            "ac_mode": run.ac_mode or self.ac_mode,
            "selective_ac_option": str(keys.get("activation_checkpoint.selective_ac_option", "op")),
            "async_tp": run.async_tp,
            "param_dtype": self.dtype,
            "gradient_accumulation_steps": run.gradient_accumulation_steps,
            "microbatch_size": int(keys.get("parallelism.pipeline_parallel_microbatch_size", 1)),
            "float8_emulate": bool(run.float8 and keys.get("quantize.dense.float8.emulate", False)),
            "fault_tolerance": run.fault_tolerance,
            "loss_chunks": int(keys.get("training.loss_chunks", 1)),
            "activation_offload": bool(keys.get("activation_checkpoint.offload", False)),
            "cpu_offload": bool(keys.get("training.enable_cpu_offload", False)),
        }

    def timeout_of(self, run: BenchRun) -> int:
        return run.timeout_s or self.timeout_s

    def rtol_of(self, run: BenchRun) -> float:
        return run.parity_rtol or self.parity_rtol

    def train_args(self, run: BenchRun, dump_folder: str) -> list[str]:
        """The `meshforge train` arguments of one run (without --nproc): base config, shared, then per-run keys."""
        keys: dict[str, Any] = {
            "model.flavor": self.flavor,
            "training.seq_len": self.seq_len_of(run),
            "training.local_batch_size": self.local_batch_size(run),
            "training.gradient_accumulation_steps": run.gradient_accumulation_steps,
            "training.steps": self.steps,
            "training.mixed_precision_param": self.dtype,
            "metrics.log_freq": 1,
            "job.dump_folder": dump_folder,
            **self.overrides,
            "parallelism.data_parallel_replicate_degree": run.dp_replicate,
            "parallelism.data_parallel_shard_degree": run.dp_shard,
            "parallelism.tensor_parallel_degree": run.tp,
            "parallelism.pipeline_parallel_degree": run.pp,
            "parallelism.context_parallel_degree": run.cp,
            "activation_checkpoint.mode": run.ac_mode or self.ac_mode,
        }
        if run.pp > 1:
            keys["parallelism.pipeline_parallel_schedule"] = run.schedule
        if run.compile:
            keys["compile.enable"] = True
        if run.float8:
            keys["quantize.dense.float8.enable"] = True
        if run.async_tp:
            keys["parallelism.enable_async_tensor_parallel"] = True
        if run.fault_tolerance:  # the replicate dimension is the torchft groups; the layout keys describe one group
            keys["parallelism.data_parallel_replicate_degree"] = 1
            keys["fault_tolerance.enable"] = True
            keys["fault_tolerance.local_replicas"] = run.dp_replicate
        keys.update(run.overrides)
        args = ["--config", self.config] if self.config else []
        for key, value in keys.items():
            args += [f"--{key}", format_value(value)]
        return args

    def config_and_overrides(self, run: BenchRun) -> tuple[str | None, list[str]]:
        """(base config path or None, dotted overrides): what `load_config` needs to rebuild the run's config."""
        args = self.train_args(run, "unused")
        return (args[1], args[2:]) if self.config else (None, args)

    def fingerprint(self, run: BenchRun) -> str:
        """Changes whenever the run's command changes: a finished run is reused only if this matches."""
        text = json.dumps([run.ranks, self.train_args(run, "<dump>"), self.threads_per_rank, self.measured_steps])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)
