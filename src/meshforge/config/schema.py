"""The job configuration: one dataclass per TOML section; each component receives only its own section. The sections
of the parallel layout are config/parallelism.py's ([parallelism], [activation_checkpoint], [compile], [quantize]),
and [data], [fault_tolerance], [gradient_sync] have modules of their own; all are importable from here.

Field docstrings (the string under each field) are the documentation `meshforge config show --help` prints.
Allowed values of a field are declared with ``Literal``; range checks live in each section's ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from meshforge.config.data import Data
from meshforge.config.fault_tolerance import FaultTolerance
from meshforge.config.gradient_sync import GradientSync
from meshforge.config.parallelism import ActivationCheckpoint, Compile, DenseQuantize, Float8, Parallelism, Quantize
from meshforge.errors import ConfigError, require_positive
from meshforge.model.flavors import get_flavor

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "Data",
    "DenseQuantize",
    "FaultTolerance",
    "Float8",
    "GradientSync",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Quantize",
    "Training",
    "Validation",
]


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Where metrics, checkpoints, traces and logs of this run are written."""
    description: str = "meshforge training job"
    """Free text shown in the first log line."""
    log_rank: str = "0"
    """Ranks that print to the console: a comma list ('0,3'), a range ('0-3') or 'all'."""
    log_to_files: bool = False
    """Every rank also writes its own log to <dump_folder>/logs/rank_R.log."""


@dataclass
class Model:
    name: Literal["llama3"] = "llama3"
    """Model family."""
    flavor: str = "debugmodel"
    """Model shape: tiny, debugmodel, 100m (CPU flavors) or 1B, 3B (tied embeddings), 8B, 70B, 405B (official Llama 3
    shapes); hf_config and the shape fields below override it."""
    tokenizer_path: str = "data/tokenizer/austen-bpe-2048.json"
    """A tokenizers-library tokenizer.json, a tiktoken BPE file (Llama 3 tokenizer.model), or hf:<repo> (network)."""
    hf_config: str = ""
    """A Hugging Face config.json (or its folder) whose shapes replace the flavor's: LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM (dense). Read locally, never downloaded."""
    dim: int = 0
    """Hidden width; this and the shape fields below override the flavor's (or hf_config's) when non-zero."""
    n_layers: int = 0
    """Transformer blocks (0 = the flavor's)."""
    n_heads: int = 0
    """Query heads (0 = the flavor's)."""
    n_kv_heads: int = 0
    """Key/value heads of grouped-query attention (0 = the flavor's)."""
    head_dim: int = 0
    """Head width when it is not dim / n_heads, as in Qwen3 (0 = dim / n_heads or the flavor's)."""
    ffn_dim: int = 0
    """SwiGLU hidden width given directly (0 = the flavor's, or ffn_dim_multiplier and multiple_of)."""
    ffn_dim_multiplier: float = 0.0
    """Meta's SwiGLU width multiplier on 8/3 x dim (0 = the flavor's)."""
    multiple_of: int = 0
    """SwiGLU width rounded up to a multiple of this (0 = the flavor's)."""
    vocab_size: int = 0
    """Embedding rows (0 = the flavor's); must hold the tokenizer's vocabulary."""
    tie_embeddings: Literal["auto", "true", "false"] = "auto"
    """Output projection shares the embedding's weight: auto = as the flavor (1B, 3B tie) or hf_config says."""
    rope_theta: float = 0.0
    """RoPE base (0 = the flavor's)."""
    rope_scaling_factor: float = 0.0
    """Llama 3 RoPE frequency scaling factor (0 = the flavor's, 1 = no scaling)."""
    moe_load_balance_coeff: float = -1.0
    """MoE flavors: expert-bias step of auxiliary-loss-free balancing (0 turns it off; -1: the flavor's)."""
    moe_aux_loss_coeff: float = -1.0
    """MoE flavors: weight of the sequence-wise auxiliary balance loss (0 turns it off; -1: the flavor's)."""
    lean_saves: bool = True
    """Exact lean saves, no matmul recomputed: RMSNorm its input + rstd, SwiGLU its two matmul outputs, SP matmuls the
    sequence shard (model/lean.py, parallel/sequence_shard_saves.py). false: torch autograd's op-by-op saves."""


@dataclass
class Training:
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-step."""
    seq_len: int = 256
    """Tokens per sequence."""
    steps: int = 50
    """Optimizer steps to run."""
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm (0 disables clipping)."""
    seed: int = 42
    """Seed of weights, data order and dropout-free randomness."""
    deterministic: bool = False
    """Use deterministic algorithms: same seed + same layout gives bitwise-identical losses."""
    dataset: str = "austen"
    """austen (shipped, offline), text (local file or folder: dataset_path), prepared (`meshforge data prepare`
    folder(s): dataset_path), c4 / hf:<name> (network). austen and text are prepared once into the cache."""
    dataset_path: str = ""
    """Path for dataset=text; for dataset=prepared a folder or a mixture DIR:weight,DIR:weight."""
    dataset_mixture: list[str] = field(default_factory=list)
    """Prepared folders with weights, ["DIR:0.7", "DIR:0.3"] (overrides dataset and dataset_path)."""
    document_mask: bool = False
    """Attention stays within each packed document and RoPE positions restart at each document start."""
    mixed_precision_param: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Dtype of parameters in forward/backward (FSDP2 MixedPrecisionPolicy, or autocast without FSDP). auto: bfloat16
    on CUDA; on a CPU the faster of float32 and bfloat16 by the cached matmul probe (stated in the start-up banner)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step (global batch = dp degree x local batch x this)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type: auto picks cuda when available."""
    skip_nonfinite_steps: int = 0
    """Skip the update of up to this many steps whose loss or grad norm is NaN/Inf; the next one stops the run."""
    loss_chunks: int = 1
    """Output projection + cross-entropy over this many token chunks, each chunk's logits recomputed in backward
    (the full tokens x vocab logits never exist; model/loss.py). 1: off."""
    enable_cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states in host memory (pinned on CUDA),
    the optimizer step on the host (parallel/cpu_offload.py). Needs FSDP; a no-op for memory on a CPU-only machine."""

    def validate(self) -> None:
        require_positive("training.local_batch_size", self.local_batch_size)
        require_positive("training.loss_chunks", self.loss_chunks)
        if self.skip_nonfinite_steps < 0:
            raise ConfigError(
                f"training.skip_nonfinite_steps = {self.skip_nonfinite_steps} must be >= 0 (0: stop at the first)"
            )
        require_positive("training.seq_len", self.seq_len)
        require_positive("training.steps", self.steps)
        require_positive("training.gradient_accumulation_steps", self.gradient_accumulation_steps)
        if self.max_norm < 0:
            raise ConfigError(f"training.max_norm = {self.max_norm} must be >= 0 (0 disables clipping)")
        if self.dataset == "text" and not self.dataset_path:
            raise ConfigError("training.dataset = 'text' needs training.dataset_path (a .txt file or folder)")
        if self.dataset == "prepared" and not (self.dataset_path or self.dataset_mixture):
            raise ConfigError(
                "training.dataset = 'prepared' needs training.dataset_path (DIR or DIR:weight,DIR:weight)"
            )


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["auto", "foreach", "for-loop", "fused"] = "auto"
    """fused (one kernel; auto: skips a non-finite step on the device, train/optim.py step_unless), foreach (one op
    over all tensors) or for-loop (tensor by tensor; these two read a skip flag on the host each step). 2-core CPU,
    FSDP/TP: for-loop's first step ~2.7 s sooner than foreach, later ones ~7 % slower (docs/benchmarks/startup.md)."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr = {self.lr} must be > 0")
        for key, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= beta < 1:
                raise ConfigError(f"optimizer.{key} = {beta} must be in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ConfigError("optimizer.eps must be > 0 and optimizer.weight_decay >= 0")


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Linear warm-up steps from 0 to the peak lr."""
    decay_type: Literal["linear", "cosine", "constant"] = "linear"
    """Shape of the decay after warm-up, down to min_lr_factor x lr at the last step."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler.warmup_steps = {self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_factor <= 1:
            raise ConfigError(f"lr_scheduler.min_lr_factor = {self.min_lr_factor} must be in [0, 1]")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the latest complete one."""
    folder: str = "checkpoint"
    """Folder under job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (0 keeps all)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background; async_with_pinned_mem needs CUDA."""
    load_step: int = -1
    """Resume from this step (-1: the latest complete checkpoint)."""
    last_save_model_only: bool = True
    """At the last step also export the weights alone to <folder>/export/step-N (step-N stays a full, resumable
    checkpoint, so the run can be extended with a larger training.steps)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of that model-only export."""
    initial_load_path: str = ""
    """Start from these weights (a seed checkpoint or an imported Hugging Face model) when no checkpoint exists."""
    create_seed_checkpoint: bool = False
    """Write the initial weights to <folder>/step-0 and exit (single process)."""
    # -- elastic resume (train/elastic.py) --
    interval_seconds: float = 0.0
    """Also save when this much wall time has passed since the last save (0: off); checked on log steps."""
    keep_global_batch: bool = True
    """On a resume under fewer (or more) data-parallel ranks, set gradient accumulation to keep the saved global
    batch (one line says so)."""

    def validate(self) -> None:
        require_positive("checkpoint.interval", self.interval)
        if self.interval_seconds < 0:
            raise ConfigError(f"checkpoint.interval_seconds = {self.interval_seconds} must be >= 0 (0: off)")
        if self.keep_latest_k < 0 or self.keep_latest_k == 1:
            raise ConfigError(
                f"checkpoint.keep_latest_k = {self.keep_latest_k} must be 0 (keep all) or >= 2 (a crash while saving "
                "must leave a complete one)"
            )


@dataclass
class Metrics:
    log_freq: int = 10
    """Log every this many steps (and the first and last)."""
    enable_tensorboard: bool = False
    """Also write TensorBoard events to <dump_folder>/tb."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package and a login)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0 when the console is a terminal."""
    # -- straggler detection (observability/straggler.py) --
    straggler_threshold: float = 0.2
    """Name a rank whose data / forward-backward / optimizer time per step exceeds the ranks' median by more than
    this share of the median step time for 3 consecutive log intervals (0: off; one all-gather per log step)."""

    def validate(self) -> None:
        require_positive("metrics.log_freq", self.log_freq)
        if self.straggler_threshold < 0:
            raise ConfigError(f"metrics.straggler_threshold = {self.straggler_threshold} must be >= 0 (0: off)")


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout for process-group start-up and the first step."""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step: a rank that waits longer exits with a message."""

    def validate(self) -> None:
        require_positive("comm.init_timeout_seconds", self.init_timeout_seconds)
        require_positive("comm.train_timeout_seconds", self.train_timeout_seconds)


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Write torch.profiler traces for a window of steps every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Folder under job.dump_folder."""
    profile_freq: int = 10
    """Steps between profiled windows."""
    profiler_active: int = 1
    """Profiled steps per window."""
    profiler_warmup: int = 3
    """Warm-up steps before each window."""
    enable_memory_snapshot: bool = False
    """CUDA allocator snapshots (also on OOM); on CPU the profiler's memory timeline."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder under job.dump_folder."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the held-out split every freq steps (no_grad, the same batches each time)."""
    freq: int = 10
    """Steps between evaluations (and at the last step)."""
    steps: int = 4
    """Batches per evaluation."""
    dataset: str = ""
    """Dataset whose val split is evaluated (same names as training.dataset); empty: training.dataset."""
    dataset_path: str = ""
    """Path for validation.dataset (as training.dataset_path)."""
    local_batch_size: int = -1
    """Sequences per data-parallel rank per batch; -1: training.local_batch_size (required under pipeline parallel)."""

    def validate(self) -> None:
        require_positive("validation.freq", self.freq)
        require_positive("validation.steps", self.steps)
        if self.local_batch_size == 0 or self.local_batch_size < -1:
            raise ConfigError(f"validation.local_batch_size = {self.local_batch_size} must be >= 1 or -1")


@dataclass
class JobConfig:
    """The whole job: what `meshforge train` runs."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    data: Data = field(default_factory=Data)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    gradient_sync: GradientSync = field(default_factory=GradientSync)

    def validate(self) -> None:
        """Check every section alone; cross-section checks (degrees vs world size, heads vs TP) live with the mesh."""
        if not self.model.hf_config:
            get_flavor(self.model.flavor)
        for section in (getattr(self, f.name) for f in fields(self)):  # every section that has its own checks
            if hasattr(section, "validate"):
                section.validate()
        if self.training.document_mask and self.parallelism.context_parallel_degree > 1:
            raise ConfigError(
                "training.document_mask with parallelism.context_parallel_degree = "
                f"{self.parallelism.context_parallel_degree} is not supported yet: turn one of them off"
            )
        if self.profiling.profile_freq < 1 or self.profiling.profiler_active < 1 or self.profiling.profiler_warmup < 0:
            raise ConfigError("profiling.profile_freq and profiling.profiler_active must be >= 1, profiler_warmup >= 0")
