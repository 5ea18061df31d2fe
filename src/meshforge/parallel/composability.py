"""What composes: one torch-free table of every parallelism against every feature, read by training's feature checks
(``ParallelDims.validate_features``, so the dry run too) and rendered to docs/composability.md.

Each cell is *parity-tested* (against one process, the test named: losses, and grad norms where that test logs
them), *runs* (smoke-tested,
finite losses), *refused* (one-line reason and the nearest working setting; training raises it before step 1) or
*untested* (no test covers it yet: nothing is claimed). Adding a parallelism or a feature is one entry in
``PARALLELISMS`` / ``FEATURES``; a cell another test measures or a refusal is one entry in ``CELLS``; the cells the
covering-array matrix test proves are ``MEASURED`` (parallel/composability_measured.py, regenerated from its run).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshforge.errors import ConfigError
from meshforge.parallel.composability_measured import MATRIX_FILE, MEASURED
from meshforge.parallel.pipeline.catalog import SCHEDULES, SPLIT_BACKWARD

Status = Literal["parity-tested", "runs", "refused", "untested"]

PARALLELISMS: dict[str, str] = {
    "fsdp": "FSDP (data_parallel_shard_degree > 1)",
    "hsdp": "HSDP (data_parallel_replicate_degree > 1)",
    "tp_sp": "TP + sequence parallel",
    "loss_parallel": "loss parallel",
    "async_tp": "async TP",
    **{f"pp_{name}": f"PP {name}" for name in SCHEDULES},
    "pp_csv": "PP CSV schedule",
    "cp_allgather": "CP all-gather",
    "cp_ring": "CP ring",
    "ep": "EP (expert parallel)",
}

FEATURES: dict[str, str] = {
    "ac_none": "AC none",
    "ac_selective_op": "AC per-op selective (default)",
    "ac_every_n": "AC every N-th block",
    "ac_full": "AC full",
    "compile": "torch.compile",
    "float8_tensorwise": "Float8 tensorwise",
    "float8_rowwise": "Float8 rowwise",
    "document_mask": "document mask",
    "validation": "validation",
    "checkpoint": "checkpoint save + resume + reshard",
    "hf_interop": "HF import / export",
    "tied_embeddings": "tied embeddings",
    "qwen_qk_norm_bias": "Qwen q/k norm + biases",
    "moe": "MoE flavors",
    "loss_chunks": "chunked loss (training.loss_chunks > 1)",
    "activation_offload": "activation offload",
    "cpu_offload": "FSDP CPU offload (training.enable_cpu_offload)",
    "grad_sync_once": "one gradient exchange per step (gradient_sync once_per_step / auto, GA > 1)",
    "regather_keep": "parameters kept gathered between micro-steps (gradient_sync.regather = keep)",
}


@dataclass(frozen=True)
class Cell:
    """One measured or refused combination."""

    status: Status
    evidence: str = ""  # the test node id (parity-tested / runs) or the refusal's reason
    alternative: str = ""  # refused only: the nearest working setting


_ZB_REASON = "per-op selective AC's saved-op cache is consumed by the split input-gradient pass"
_ZB_FIX = "activation_checkpoint.selective_ac_option = 2 (every 2nd block), or mode = 'full' / 'none'"
_MOE_PARITY = "tests/distributed/test_moe_parity.py"
_CHUNKED = "tests/distributed/test_chunked_loss_parity.py"
_CHUNKED_TP = f"{_CHUNKED}::test_fsdp2_tp2_loss_parallel_chunked_loss_matches_unchunked"
_GRAD_SYNC = "tests/distributed/test_gradient_sync_composability.py"
_GRAD_SYNC_TEST = f"{_GRAD_SYNC}::test_once_per_step_matches_one_process_across_layouts_and_features"
# one job per row at GA 2 against one process; FSDP's jobs also run it with CPU offload, activation offload, compile
# (aot_eager) and Float8 rowwise; keep is ignored under PP (the schedule keeps its stages gathered), not claimed there
# torchft replica groups (no row) too: test_fault_tolerant_groups_with_once_per_step_match_one_process, same file
_GRAD_SYNC_KEEP = ("fsdp", "hsdp", "tp_sp", "loss_parallel", "cp_allgather", "cp_ring", "ep")
_GRAD_SYNC_ROWS = {
    "grad_sync_once": (*_GRAD_SYNC_KEEP, *(f"pp_{name}" for name in SCHEDULES)),  # each schedule x FSDP 2
    "regather_keep": _GRAD_SYNC_KEEP,
}

CELLS: dict[tuple[str, str], Cell] = {
    ("fsdp", "ac_none"): Cell("parity-tested", "tests/distributed/test_fsdp_parity.py"),
    ("fsdp", "compile"): Cell("parity-tested", "tests/distributed/test_ac_compile_float8.py::test_fsdp2_with_compile"),
    ("fsdp", "moe"): Cell("parity-tested", f"{_MOE_PARITY}::test_ep2_fsdp2_matches_single_process"),
    ("tp_sp", "document_mask"): Cell("parity-tested", "tests/distributed/test_document_mask_parity.py"),
    ("tp_sp", "validation"): Cell("parity-tested", "tests/distributed/test_validation_parity.py"),
    ("fsdp", "checkpoint"): Cell("parity-tested", "tests/distributed/test_checkpoint_reshard.py"),
    ("fsdp", "tied_embeddings"): Cell("parity-tested", "tests/distributed/test_tied_embeddings.py"),
    ("tp_sp", "qwen_qk_norm_bias"): Cell("parity-tested", "tests/distributed/test_qwen_parity.py"),
    ("tp_sp", "ac_none"): Cell("parity-tested", "tests/distributed/test_tp_cp_parity.py"),
    ("cp_allgather", "ac_none"): Cell("parity-tested", "tests/distributed/test_tp_cp_parity.py"),
    ("ep", "ac_none"): Cell("parity-tested", f"{_MOE_PARITY}::test_ep2_tp2_matches_single_process"),
    ("ep", "moe"): Cell("parity-tested", f"{_MOE_PARITY}::test_ep2_matches_single_process"),
    ("ep", "ac_selective_op"): Cell(
        "parity-tested", f"{_MOE_PARITY}::test_dp2_tp2_ep2_under_default_selective_ac_matches_single_process"
    ),
    ("ep", "checkpoint"): Cell("parity-tested", "tests/distributed/test_moe_checkpoint.py"),
    ("ep", "compile"): Cell(
        "refused",
        "torch.compile cannot trace the data-dependent token all-to-all sizes",
        "compile.enable = false (MoE without EP compiles: tests/unit/test_moe_compile.py)",
    ),
    ("fsdp", "loss_chunks"): Cell("parity-tested", f"{_CHUNKED}::test_fsdp2_chunked_loss_matches_unchunked"),
    ("tp_sp", "loss_chunks"): Cell("parity-tested", _CHUNKED_TP),
    ("loss_parallel", "loss_chunks"): Cell("parity-tested", _CHUNKED_TP),
    ("pp_1F1B", "loss_chunks"): Cell("parity-tested", f"{_CHUNKED}::test_pp2_chunked_loss_matches_unchunked"),
    ("fsdp", "cpu_offload"): Cell(
        "parity-tested", "tests/distributed/test_cpu_offload.py::test_fsdp2_cpu_offload_matches_single_process"
    ),
    **{(row, col): Cell("parity-tested", _GRAD_SYNC_TEST) for col, rows in _GRAD_SYNC_ROWS.items() for row in rows},
    **{
        (f"pp_{name}", "ac_selective_op"): Cell("refused", _ZB_REASON, _ZB_FIX)
        for name in SCHEDULES
        if name in SPLIT_BACKWARD
    },
    **{
        (f"pp_{name}", "compile"): Cell(
            "refused",
            "torch cannot split the backward of compiled blocks into input and weight gradients",
            "compile.enable = false, or the 1F1B / Interleaved1F1B schedule",
        )
        for name in SCHEDULES
        if name in SPLIT_BACKWARD
    },
    **{
        (f"pp_{name}", "tied_embeddings"): Cell(
            "refused",
            "the embedding and the output projection live on different pipeline stages",
            "model.tie_embeddings = 'false', or pipeline_parallel_degree 1",
        )
        for name in SCHEDULES
    },
    ("cp_ring", "compile"): Cell(
        "refused",
        "ring attention's point-to-point sends do not trace inside compiled blocks",
        "context_parallel_impl = 'allgather' (or 'auto'), or compile.enable = false",
    ),
    **{
        (cp, "document_mask"): Cell(
            "refused",
            "the document mask is not sharded over context-parallel ranks yet",
            "training.document_mask = false, or context_parallel_degree 1",
        )
        for cp in ("cp_allgather", "cp_ring")
    },
}


@dataclass(frozen=True)
class Interaction:
    """A refusal of three or more settings together: any of ``rows`` with all of ``features`` (each pair runs), on
    the ``devices`` where it was measured (elsewhere nothing is claimed)."""

    rows: frozenset[str]
    features: frozenset[str]
    reason: str
    alternative: str
    devices: frozenset[str]


_TP_RECOMPUTE = (
    "an MoE block under TP must be compiled around its checkpoint (compiled inside it, the replayed forward would "
    "count routed tokens twice), and there AOT autograd saves a DeviceMesh among the recomputed tensors (torch 2.13: "
    "'expected all tensors_saved_with_vc_check to be Tensors'); dense blocks are compiled inside the checkpoint"
)
_TP_RECOMPUTE_FIX = "activation_checkpoint.selective_ac_option = 'op' (per-op, measured to run) or mode = 'none'"
INTERACTIONS: list[Interaction] = [
    # not device-specific (AOT autograd); dense TP + compile + full / every-N AC runs (parallelize.apply_compile,
    # tests/distributed/test_tp_compile_full_ac.py), as the 70B / 405B configs use it
    Interaction(
        frozenset({"tp_sp"}),
        frozenset({"compile", ac, "moe"}),
        _TP_RECOMPUTE,
        _TP_RECOMPUTE_FIX,
        frozenset({"cpu", "cuda"}),
    )
    for ac in ("ac_full", "ac_every_n")
]


def cell(parallelism: str, feature: str) -> Cell:
    """The table's cell (``untested`` where nothing is recorded); unknown names are a bug, not a user mistake."""
    if parallelism not in PARALLELISMS or feature not in FEATURES:
        raise KeyError(f"composability table has no cell ({parallelism!r}, {feature!r})")
    if (parallelism, feature) in CELLS:
        return CELLS[parallelism, feature]
    if (parallelism, feature) in MEASURED:
        status, test = MEASURED[parallelism, feature]
        return Cell(status, f"{MATRIX_FILE}::{test}")
    return Cell("untested")


def refusal(parallelisms: list[str], features: list[str], device: str = "") -> ConfigError | None:
    """The first refused cell among the active parallelisms x features (then the three-way refusals measured on
    ``device``: "" checks none), as the one-line error, or None."""
    for p in parallelisms:
        for f in features:
            c = cell(p, f)
            if c.status == "refused":
                return ConfigError(
                    f"{PARALLELISMS[p]} with {FEATURES[f]} is refused: {c.evidence}; use {c.alternative}"
                )
    for rule in INTERACTIONS:
        hit = [p for p in parallelisms if p in rule.rows]
        if hit and rule.features <= set(features) and device in rule.devices:
            together = " + ".join(FEATURES[f] for f in sorted(rule.features))
            return ConfigError(
                f"{PARALLELISMS[hit[0]]} with {together} is refused: {rule.reason}; use {rule.alternative}"
            )
    return None


def check(parallelisms: list[str], features: list[str], device: str = "") -> None:
    """Raise the table's refusal for this combination on ``device``, if any (before any process group or step)."""
    error = refusal(parallelisms, features, device)
    if error is not None:
        raise error


def active_parallelisms(
    parallelism: object, *, dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int, cp_impl: str
) -> list[str]:
    """The table's parallelism rows a job uses (``parallelism``: the config's Parallelism section)."""
    get = parallelism.__getattribute__
    rows = [name for name, on in (("fsdp", dp_shard > 1), ("hsdp", dp_replicate > 1), ("ep", ep > 1)) if on]
    if tp > 1:
        rows.append("tp_sp")
        rows += [] if get("disable_loss_parallel") else ["loss_parallel"]
        rows += ["async_tp"] if get("enable_async_tensor_parallel") else []
    if pp > 1:
        csv = bool(get("pipeline_parallel_schedule_csv"))
        rows.append("pp_csv" if csv else f"pp_{get('pipeline_parallel_schedule')}")
    if cp > 1:
        rows.append("cp_ring" if cp_impl == "ring" else "cp_allgather")
    return [r for r in rows if r in PARALLELISMS]


def active_features(*, ac_mode: str, ac_option: str, compile_enabled: bool, float8_recipe: str = "") -> list[str]:
    """The table's feature columns for an AC mode / option, compile and a Float8 recipe ("" = off)."""
    ac = {"none": "ac_none", "full": "ac_full"}.get(ac_mode, "ac_selective_op" if ac_option == "op" else "ac_every_n")
    return [ac] + (["compile"] if compile_enabled else []) + ([f"float8_{float8_recipe}"] if float8_recipe else [])


def job_features(cfg: Any, model_args: Any) -> list[str]:
    """Every feature column a job uses, from its JobConfig and its resolved ModelArgs (duck-typed: torch-free)."""
    ac, training, float8, sync = cfg.activation_checkpoint, cfg.training, cfg.quantize.dense.float8, cfg.gradient_sync
    once = training.gradient_accumulation_steps > 1 and sync.mode != "every_microstep"  # parallel/gradient_sync.py
    out = active_features(
        ac_mode=ac.mode,
        ac_option=ac.selective_ac_option,
        compile_enabled=cfg.compile.enable,
        float8_recipe=float8.recipe_name if float8.enable else "",
    )
    flags = {
        "document_mask": training.document_mask,
        "validation": cfg.validation.enable,
        "checkpoint": cfg.checkpoint.enable,
        "tied_embeddings": model_args.tie_embeddings,
        "qwen_qk_norm_bias": model_args.qk_norm or model_args.qkv_bias,
        "moe": model_args.is_moe,
        "loss_chunks": training.loss_chunks > 1,
        "activation_offload": ac.offload,
        "cpu_offload": training.enable_cpu_offload,
        "grad_sync_once": once,
        "regather_keep": once and sync.regather == "keep",
    }
    return out + [name for name, on in flags.items() if on]


def counts() -> dict[str, int]:
    """How many cells have each status."""
    out = {"parity-tested": 0, "runs": 0, "refused": 0, "untested": 0}
    for p in PARALLELISMS:
        for f in FEATURES:
            out[cell(p, f).status] += 1
    return out


_MARK = {"parity-tested": "P", "runs": "R", "refused": "X", "untested": "·"}


def render_markdown() -> str:
    """docs/composability.md, generated from the table."""
    lines = [
        "# Composability: every parallelism x every feature",
        "",
        "Generated from `src/meshforge/parallel/composability.py` by `python -m meshforge.parallel.composability`;"
        " do not edit by hand (tests/unit/test_composability.py fails when this page is stale).",
        "",
        "P = parity-tested against one process (losses and grad norms), R = runs (smoke-tested), X = refused before"
        " step 1 (reason and alternative below), · = untested (nothing claimed).",
        "",
        "Most P / R cells are proved by the covering-array matrix (`tests/distributed/test_composability_matrix.py`):"
        " 2-step jobs on debugmodel / debugmoe / a tiny Qwen3, 2 or 4 gloo ranks, fp32, every allowed pair of"
        " feature values in some job; `make test` runs it over FSDP, TP, PP 1F1B, PP ZBV, CP all-gather and EP,"
        " `make test-matrix` over every layout. A cell is P where a job through it matched one process (losses and"
        " grad norms to 1e-5 relative; a Float8 job at its first step: docs/benchmarks/cpu-parity-noise.md), R where"
        " its jobs finished with finite losses. Compile cells of the matrix"
        " trace with the aot_eager backend (dynamo + AOT autograd).",
        "",
        "Counts: " + ", ".join(f"{k} {v}" for k, v in counts().items()) + ".",
        "",
        "| parallelism | " + " | ".join(FEATURES.values()) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for p, label in PARALLELISMS.items():
        lines.append(f"| {label} | " + " | ".join(_MARK[cell(p, f).status] for f in FEATURES) + " |")
    lines += ["", "## Refused", ""]
    lines += [
        f"- {PARALLELISMS[p]} x {FEATURES[f]}: {c.evidence}; use {c.alternative}."
        for (p, f), c in CELLS.items()
        if c.status == "refused"
    ]
    lines += [
        f"- {' / '.join(PARALLELISMS[p] for p in sorted(rule.rows))} x "
        f"{' + '.join(FEATURES[f] for f in sorted(rule.features))} (together, on {' / '.join(sorted(rule.devices))};"
        f" each pair runs): {rule.reason}; use {rule.alternative}."
        for rule in INTERACTIONS
    ]
    lines += ["", "## Evidence", ""]
    lines += [
        f"- {PARALLELISMS[p]} x {FEATURES[f]} ({c.status}): `{c.evidence}`"
        for (p, f), c in CELLS.items()
        if c.status != "refused"
    ]
    return "\n".join(lines) + "\n"


DOC = Path(__file__).resolve().parents[3] / "docs" / "composability.md"

if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DOC
    target.write_text(render_markdown())
    print(f"wrote {target}")
