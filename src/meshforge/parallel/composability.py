"""What composes: one torch-free table of every parallelism against every feature, read by training's feature checks
(``ParallelDims.validate_features``, so the dry run too) and rendered to docs/composability.md.

Each cell is *parity-tested* (against one process, the test named: losses, and grad norms where that test logs
them), *runs* (smoke-tested,
finite losses), *refused* (one-line reason and the nearest working setting; training raises it before step 1) or
*untested* (no test covers it yet: nothing is claimed). Adding a parallelism or a feature is one entry in
``PARALLELISMS`` / ``FEATURES``; a measured cell is one entry in ``CELLS``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshforge.errors import ConfigError
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
    **{
        (f"pp_{name}", "ac_selective_op"): Cell("refused", _ZB_REASON, _ZB_FIX)
        for name in SCHEDULES
        if name in SPLIT_BACKWARD
    },
}


def cell(parallelism: str, feature: str) -> Cell:
    """The table's cell (``untested`` where nothing is recorded); unknown names are a bug, not a user mistake."""
    if parallelism not in PARALLELISMS or feature not in FEATURES:
        raise KeyError(f"composability table has no cell ({parallelism!r}, {feature!r})")
    return CELLS.get((parallelism, feature), Cell("untested"))


def refusal(parallelisms: list[str], features: list[str]) -> ConfigError | None:
    """The first refused cell among the active parallelisms x features, as the one-line error, or None."""
    for p in parallelisms:
        for f in features:
            c = cell(p, f)
            if c.status == "refused":
                return ConfigError(
                    f"{PARALLELISMS[p]} with {FEATURES[f]} is refused: {c.evidence}; use {c.alternative}"
                )
    return None


def check(parallelisms: list[str], features: list[str]) -> None:
    """Raise the table's refusal for this combination, if any (before any process group or step)."""
    error = refusal(parallelisms, features)
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
