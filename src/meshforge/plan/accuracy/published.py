"""Every published training run the planner is judged on: one definition, each row with its source and its reading.

A row is the setup as the config overrides `meshforge plan` takes, the world size, the hardware preset, and the
tokens/s per GPU and peak memory (GiB) its source prints. ``bench/reference.py`` derives the article's figures (the
rows with an ``article_table``) from here; ``plan/accuracy/loo.py`` fits and cross-validates the planner on all of them.

Readings of what the sources leave open (docs/planner.md, "The published rows"):
- TorchTitan's ``memory: X GiB`` log line is ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]`` / 2^30: the
  caching allocator's reserved peak in GiB (train.py at 9dec370); torchao's README column "Peak Memory (GB)" is that
  same figure (its parse script reads the log line).
- Pipeline microbatches at TorchTitan 9dec370 (the Dec-2024 report): ``n_microbatches = pipeline_parallel_degree``
  when not given (pipelining_utils.build_pipeline_schedule), so local batch 32 ran as 8 x 4 under both 1F1B and
  interleaved 1F1B, and table 4's batch 8 as 8 x 1.
- Where a source gives no sequence length, the TOML preset at the measured commit has seq_len 8192.
- All rows ran TorchTitan's code (``impl = "torchtitan"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.plan.accuracy.sources import SOURCES, Source

__all__ = ["EXCLUDED", "RUNS", "SOURCES", "TABLES", "Run", "Source", "article_runs", "run"]


TABLES = {
    1: "Table 1: Llama 3.1 8B, 8 GPUs, FSDP 8, local batch 2, selective AC, seq 8192",
    2: "Table 2: Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, compile + Float8, local batch 16, full AC",
    3: "Table 3: Llama 3.1 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, compile + Float8 + async TP, local batch 32, full AC",
    4: "Table 4: Llama 3.1 405B, 512 GPUs, 4D (TP 8, PP 8, FSDP x CP = 8), 1F1B, local batch 8, full AC",
}
"""The article's tables (it quotes tables 1, 4, 5 and 6 of the Dec-2024 report)."""


@dataclass(frozen=True)
class Run:
    """One published row."""

    key: str
    source: str
    name: str
    hardware: str
    world_size: int
    overrides: tuple[str, ...]
    tps: float
    memory_gib: float | None = None
    article_table: int = 0
    """The article's table (1-4) quoting this row, or 0."""
    label: str = ""
    """The row's name within its article table."""
    baseline: str = ""
    """Key of the article table's first row (the ratio's denominator)."""
    reading: str = ""
    """What the source leaves open and how the row reads it."""
    compiled_loss: bool = False
    """TorchTitan at the row's commit compiles the loss with compile on (from bbb1b61, 2025-04-02; 9dec370 had it
    commented out since e8977b0, 2024-12-18): plan/layout.py Layout.compiled_loss."""


_SEQ = "--training.seq_len 8192"
_FAST = "--compile.enable --quantize.dense.float8.enable"
_ASYNC = "--parallelism.enable_async_tensor_parallel"
_8B = f"{_SEQ} --model.flavor 8B --activation_checkpoint.mode selective"
_T1 = f"{_8B} --training.local_batch_size 2"
_70B = (
    f"{_SEQ} --model.flavor 70B --training.local_batch_size 16 --parallelism.tensor_parallel_degree 8 "
    "--activation_checkpoint.mode full"
)
_T2 = f"{_70B} {_FAST}"
_405B = (
    f"{_FAST} --model.flavor 405B --parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 8 "
    f"{_ASYNC} --activation_checkpoint.mode full"
)
_PP = "--parallelism.pipeline_parallel_schedule {} --parallelism.pipeline_parallel_microbatch_size {}"
_405B_2D = f"{_SEQ} --model.flavor 405B --training.local_batch_size 2 --parallelism.tensor_parallel_degree 8 " + (
    "--activation_checkpoint.mode full"
)
_8B_TP = f"{_8B} --training.local_batch_size 12 --parallelism.tensor_parallel_degree 8 --compile.enable"
_NO_SEQ = "sequence length not stated: the preset's 8192"
_TRAINY = (
    "force_recompute_fp8_weight_in_bwd (not modelled); loss compiled: the source's command passes --training.compile "
    "(pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md @ cbccb387871a, lines 26-33) at "
    "its stated torchtitan e7c0cae934df78d6e9c2835f42ff1f757dc3fddc (line 54), whose "
    "torchtitan/components/loss.py lines 27-29 torch.compile the loss when training.compile is set"
)
_B200 = "power limit not stated (the b200 preset's family factor absorbs it); loss compiled (torchtitan 6fc499f)"
_MB = "microbatches: TorchTitan 9dec370's default, one per pipeline rank (8)"


def _run(key: str, source: str, name: str, hw: str, world: int, args: str, tps: float, mem: float | None, **kw: object):
    return Run(key, source, name, hw, world, tuple(args.split()), tps, mem, **kw)  # type: ignore[arg-type]


def _t1(key: str, label: str, args: str, tps: float, mem: float) -> Run:
    name = f"8B FSDP{label.removeprefix('FSDP')}"
    return _run(
        key,
        "tt-2024-12",
        name,
        "h100-96gb",
        8,
        args,
        tps,
        mem,
        article_table=1,
        label=label,
        baseline="table1.fsdp",
        reading=_NO_SEQ,
    )


def _t4(seq: int, cp: int, tps: float, mem: float, table: int = 4) -> Run:
    args = f"{_405B} --training.seq_len {seq} --training.local_batch_size 8 --parallelism.context_parallel_degree {cp} "
    args += "--parallelism.context_parallel_impl allgather " + _PP.format("1F1B", 1)
    key = f"table4.seq{seq // 1024}k" if table else f"tt-2024-12.405b_seq{seq // 1024}k"
    name = f"405B 4D seq {seq} (FSDP {8 // cp}, CP {cp})"
    reading = "CP all-gathers K/V (torch's CP of Dec 2024); " + _MB
    return _run(
        key,
        "tt-2024-12",
        name,
        "h100-96gb",
        512,
        args,
        tps,
        mem,
        article_table=table,
        label=f"seq {seq:,}",
        baseline="table4.seq32k" if table else "",
        reading=reading,
    )


def _cp8b(seq: int, cp: int, tps: float, mem: float) -> Run:
    args = f"{_FAST} --model.flavor 8B --training.seq_len {seq} --training.local_batch_size 1 "
    args += f"--activation_checkpoint.mode full --parallelism.context_parallel_degree {cp} "
    args += "--parallelism.context_parallel_impl allgather"
    return _run(
        f"tt-2024-12.8b_cp_seq{seq // 1024}k",
        "tt-2024-12",
        f"8B CP seq {seq} (FSDP {8 // cp}, CP {cp})",
        "h100-96gb",
        8,
        args,
        tps,
        mem,
        reading="CP all-gathers K/V (torch's CP of Dec 2024)",
    )


def _tp_bench(key: str, name: str, flavor_args: str, world: int, tps: float, fp8: bool, async_tp: bool) -> Run:
    args = flavor_args + (" --quantize.dense.float8.enable" if fp8 else "") + (f" {_ASYNC}" if async_tp else "")
    reading = _NO_SEQ + ("; Float8 tensorwise, all-gather in Float8 (not stated)" if fp8 else "")
    return _run(key, "tt-asynctp-2025-06", name, "h100-96gb", world, args, tps, None, reading=reading)


RUNS: tuple[Run, ...] = (
    # TorchTitan's Dec-2024 H100 report: the article's tables 1-4 ...
    _t1("table1.fsdp", "FSDP", _T1, 5762, 82.4),
    _t1("table1.fsdp_compile", "FSDP + compile", f"{_T1} --compile.enable", 6667, 77.0),
    _t1("table1.fsdp_compile_float8", "FSDP + compile + Float8", f"{_T1} {_FAST}", 8532, 76.8),
    _run(
        "table2.2d",
        "tt-2024-12",
        "70B FSDP 32 x TP 8",
        "h100-96gb",
        256,
        _T2,
        829,
        71.9,
        article_table=2,
        label="2D (FSDP + TP)",
        baseline="table2.2d",
        reading=_NO_SEQ,
    ),
    _run(
        "table2.2d_async_tp",
        "tt-2024-12",
        "70B FSDP 32 x TP 8 + async TP",
        "h100-96gb",
        256,
        f"{_T2} {_ASYNC}",
        876,
        67.6,
        article_table=2,
        label="2D + async TP",
        baseline="table2.2d",
        reading=_NO_SEQ,
    ),
    _run(
        "table3.1f1b",
        "tt-2024-12",
        "405B 3D 1F1B",
        "h100-96gb",
        512,
        f"{_405B} {_SEQ} --training.local_batch_size 32 {_PP.format('1F1B', 4)}",
        100,
        82.5,
        article_table=3,
        label="1F1B",
        baseline="table3.1f1b",
        reading=f"{_NO_SEQ}; {_MB}",
    ),
    _run(
        "table3.interleaved_1f1b",
        "tt-2024-12",
        "405B 3D interleaved 1F1B",
        "h100-96gb",
        512,
        f"{_405B} {_SEQ} --training.local_batch_size 32 {_PP.format('Interleaved1F1B', 4)}",
        128,
        72.7,
        article_table=3,
        label="interleaved 1F1B",
        baseline="table3.1f1b",
        reading=f"{_NO_SEQ}; {_MB}, 2 stages per rank",
    ),
    _t4(32768, 1, 76, 75.3),
    _t4(65536, 2, 47, 75.9),
    _t4(131072, 4, 31, 77.1),
    # ... and the report's rows the article does not quote
    _run("tt-2024-12.8b_128", "tt-2024-12", "8B FSDP 128 GPUs", "h100-96gb", 128, _T1, 5605, 67.0, reading=_NO_SEQ),
    _run(
        "tt-2024-12.8b_128_compile",
        "tt-2024-12",
        "8B FSDP + compile, 128 GPUs",
        "h100-96gb",
        128,
        f"{_T1} --compile.enable",
        6514,
        62.0,
        reading=_NO_SEQ,
    ),
    _run(
        "tt-2024-12.8b_128_float8",
        "tt-2024-12",
        "8B FSDP + compile + Float8, 128 GPUs",
        "h100-96gb",
        128,
        f"{_T1} {_FAST}",
        8380,
        61.8,
        reading=_NO_SEQ,
    ),
    _cp8b(32768, 1, 3890, 83.9),
    _cp8b(65536, 2, 2540, 84.2),
    _cp8b(131072, 4, 1071, 84.0),
    _cp8b(262144, 8, 548, 84.5),
    _t4(262144, 8, 16, 84.9, table=0),
    # TorchTitan's Aug-2024 405B 2D rows (128 GPUs)
    _run(
        "tt-2024-08.405b_2d",
        "tt-2024-08",
        "405B FSDP 16 x TP 8, 128 GPUs",
        "h100-96gb",
        128,
        _405B_2D,
        109,
        None,
        reading=f"{_NO_SEQ}; 'None' read as no compile, no Float8",
    ),
    _run(
        "tt-2024-08.405b_2d_float8",
        "tt-2024-08",
        "405B 2D + compile + Float8, 128 GPUs",
        "h100-96gb",
        128,
        f"{_405B_2D} {_FAST}",
        177,
        None,
        reading=f"{_NO_SEQ}; compile on (the preset's)",
    ),
    _run(
        "tt-2024-08.405b_2d_float8_async",
        "tt-2024-08",
        "405B 2D + Float8 + async TP, 128 GPUs",
        "h100-96gb",
        128,
        f"{_405B_2D} {_FAST} {_ASYNC}",
        185,
        None,
        reading=f"{_NO_SEQ}; compile on (the preset's)",
    ),
    # TorchTitan's async-TP benchmark, June 2025 (tensorwise Float8; the rowwise rows are excluded below)
    _tp_bench("tt-asynctp.70b_bf16", "70B 2D bf16 (2025-06)", f"{_70B} --compile.enable", 256, 597.3, False, False),
    _tp_bench(
        "tt-asynctp.70b_bf16_async", "70B 2D bf16 + async TP", f"{_70B} --compile.enable", 256, 652.4, False, True
    ),
    _tp_bench("tt-asynctp.70b_fp8", "70B 2D Float8 (2025-06)", f"{_70B} --compile.enable", 256, 809.8, True, False),
    _tp_bench(
        "tt-asynctp.70b_fp8_async", "70B 2D Float8 + async TP", f"{_70B} --compile.enable", 256, 942.4, True, True
    ),
    _tp_bench("tt-asynctp.8b_bf16", "8B FSDP 8 x TP 8 bf16", _8B_TP, 64, 4378, False, False),
    _tp_bench("tt-asynctp.8b_bf16_async", "8B FSDP 8 x TP 8 bf16 + async TP", _8B_TP, 64, 4809.4, False, True),
    _tp_bench("tt-asynctp.8b_fp8", "8B FSDP 8 x TP 8 Float8", _8B_TP, 64, 5078.1, True, False),
    _tp_bench("tt-asynctp.8b_fp8_async", "8B FSDP 8 x TP 8 Float8 + async TP", _8B_TP, 64, 5570.1, True, True),
    # torchao's Float8 README (8 x H100, batch 1, seq 8192, compile, FSDP2, per-op SAC)
    _run(
        "torchao.8b_bf16",
        "torchao-float8",
        "8B FSDP 8, batch 1, compile (torchao)",
        "h100",
        8,
        f"{_8B} --training.local_batch_size 1 --compile.enable",
        6150,
        47.65,
        reading="H100 variant not stated",
    ),
    _run(
        "torchao.8b_fp8",
        "torchao-float8",
        "8B FSDP 8, batch 1, compile + Float8 (torchao)",
        "h100",
        8,
        f"{_8B} --training.local_batch_size 1 {_FAST}",
        7689.5,
        47.77,
        reading="H100 variant not stated; tensorwise, Float8 all-gather",
    ),
    # Trainy's H200 benchmark (llama3_8b.toml, local batch 2, compile, Float8 with Float8 all-gather)
    _run(
        "trainy.8b_32",
        "tt-trainy-h200",
        "8B FSDP 32 on H200, Float8",
        "h200",
        32,
        f"{_T1} {_FAST}",
        10938,
        47.96,
        reading=_TRAINY,
        compiled_loss=True,
    ),
    _run(
        "trainy.8b_64",
        "tt-trainy-h200",
        "8B FSDP 64 on H200, Float8",
        "h200",
        64,
        f"{_T1} {_FAST}",
        10753,
        46.97,
        reading=_TRAINY,
        compiled_loss=True,
    ),
    # torchao's MX README on B200 (8 x B200 power limited, batch 1, seq 8192, compile, FSDP2, per-op SAC)
    _run(
        "torchao-b200.8b_bf16",
        "torchao-mx-b200",
        "8B FSDP 8 on B200, batch 1, compile",
        "b200",
        8,
        f"{_8B} --training.local_batch_size 1 --compile.enable",
        8307.5,
        33.71,
        reading=_B200,
        compiled_loss=True,
    ),
    _run(
        "torchao-b200.8b_fp8",
        "torchao-mx-b200",
        "8B FSDP 8 on B200, batch 1, compile + Float8",
        "b200",
        8,
        f"{_8B} --training.local_batch_size 1 {_FAST}",
        10417.0,
        33.38,
        reading=f"{_B200}; Float8 tensorwise with Float8 all-gather",
        compiled_loss=True,
    ),
    # TorchTitan's April-2024 A100 rows (FSDP 64, local batch 1, no compile)
    _run(
        "tt-a100.8b_sac_op",
        "tt-2024-04-a100",
        "8B FSDP 64 on A100, selective-op AC",
        "a100",
        64,
        f"{_8B} --training.local_batch_size 1",
        2973,
        None,
        reading=_NO_SEQ,
    ),
    _run(
        "tt-a100.70b_full",
        "tt-2024-04-a100",
        "70B FSDP 64 on A100, full AC",
        "a100",
        64,
        f"{_SEQ} --model.flavor 70B --training.local_batch_size 1 --activation_checkpoint.mode full",
        331,
        None,
        reading=_NO_SEQ,
    ),
)

EXCLUDED: tuple[tuple[str, str], ...] = (
    ("torchtitan#773 InterleavedZeroBubble 405B (13 tps, 89.73 GiB)", "documents a bug (slow with AC), per the thread"),
    (
        "tt-asynctp-2025-06 rowwise Float8 rows (599.6, 624.8, 3708.5, 3914.9 tps)",
        "the planner has no rowwise recipe; the source calls their baseline anomalous (#1207)",
    ),
    ("torchao-float8 rowwise row (6768 tps, 47.79 GiB)", "the planner has no rowwise recipe"),
    (
        "torchao-mx-b200 mxfp8_cublas / mxfp8_cublas_rceil / float8 rowwise rows (9969, 9642 tps, ...)",
        "the planner has no MX or rowwise recipe",
    ),
    ("torchtitan docs/mxfp8.md Llama4 Scout 512 GB200 rows (6169 / 7401 tps)", "no Llama 4 flavor; GB200, no memory"),
    ("torchtitan#1207 8B FSDP 2 x TP 2 (5378 / 5189 tps)", "sequence length, batch and compile not stated"),
    ("tt-2024-04-a100 8B selective-layer row (2904 tps)", "the N of 'every N-th layer' is not stated"),
    ("NeMo 24.07 Llama 3 8B / 70B rows", "another implementation (Megatron-Core, ZeRO-1, TE FP8), AC not stated"),
    ("TorchTitan paper (arXiv 2410.06511) tables", "not retrieved; its ratios do not match the report's"),
)
"""Published rows seen and not used, with the reason."""


def run(key: str) -> Run:
    """The published row ``key``; KeyError listing the keys otherwise."""
    for r in RUNS:
        if r.key == key:
            return r
    raise KeyError(f"{key!r} is not a published row: {', '.join(r.key for r in RUNS)}")


def article_runs() -> tuple[Run, ...]:
    """The rows the article quotes (its tables 1-4), in table order."""
    return tuple(r for r in RUNS if r.article_table)
