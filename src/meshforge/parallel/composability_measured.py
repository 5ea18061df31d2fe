"""The cells the covering-array matrix tests prove (tests/distributed/test_composability_matrix.py): each cell's best
status and the test that proves it (``test_pairwise_matrix``, CI's, where both do). Regenerated from their runs:
``MESHFORGE_MATRIX_OUT=ci.json`` (pytest) / ``MESHFORGE_MATRIX_OUT=full.json make test-matrix``, then ``python -m
meshforge.parallel.composability_measured ci.json full.json``; each test fails when this table claims for it more,
or less, than its run shows. Torch-free."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

MATRIX_FILE = "tests/distributed/test_composability_matrix.py"
RANK = {"runs": 1, "parity-tested": 2}

MEASURED: dict[tuple[str, str], tuple[Literal["parity-tested", "runs"], str]] = {
    ("cp_allgather", "ac_every_n"): ("parity-tested", "test_full_matrix"),
    ("cp_allgather", "ac_full"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "ac_selective_op"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "compile"): ("parity-tested", "test_full_matrix"),
    ("cp_allgather", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "float8_tensorwise"): ("runs", "test_pairwise_matrix"),
    ("cp_allgather", "loss_chunks"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "moe"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "qwen_qk_norm_bias"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "tied_embeddings"): ("parity-tested", "test_pairwise_matrix"),
    ("cp_allgather", "validation"): ("runs", "test_pairwise_matrix"),
    ("cp_ring", "ac_every_n"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "ac_none"): ("runs", "test_full_matrix"),
    ("cp_ring", "ac_selective_op"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("cp_ring", "loss_chunks"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "moe"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "qwen_qk_norm_bias"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "tied_embeddings"): ("parity-tested", "test_full_matrix"),
    ("cp_ring", "validation"): ("runs", "test_full_matrix"),
    ("ep", "ac_every_n"): ("parity-tested", "test_pairwise_matrix"),
    ("ep", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("ep", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("ep", "document_mask"): ("parity-tested", "test_pairwise_matrix"),
    ("ep", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("ep", "float8_tensorwise"): ("runs", "test_pairwise_matrix"),
    ("ep", "loss_chunks"): ("runs", "test_pairwise_matrix"),
    ("ep", "tied_embeddings"): ("parity-tested", "test_full_matrix"),
    ("ep", "validation"): ("runs", "test_pairwise_matrix"),
    ("fsdp", "ac_every_n"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "ac_full"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "ac_selective_op"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "document_mask"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "float8_tensorwise"): ("runs", "test_pairwise_matrix"),
    ("fsdp", "qwen_qk_norm_bias"): ("parity-tested", "test_pairwise_matrix"),
    ("fsdp", "validation"): ("runs", "test_pairwise_matrix"),
    ("hsdp", "ac_every_n"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "ac_selective_op"): ("runs", "test_full_matrix"),
    ("hsdp", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "compile"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "document_mask"): ("runs", "test_full_matrix"),
    ("hsdp", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("hsdp", "loss_chunks"): ("runs", "test_full_matrix"),
    ("hsdp", "moe"): ("parity-tested", "test_full_matrix"),
    ("hsdp", "qwen_qk_norm_bias"): ("runs", "test_full_matrix"),
    ("hsdp", "tied_embeddings"): ("runs", "test_full_matrix"),
    ("hsdp", "validation"): ("runs", "test_full_matrix"),
    ("loss_parallel", "ac_every_n"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "ac_full"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "ac_none"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "ac_selective_op"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "compile"): ("parity-tested", "test_full_matrix"),
    ("loss_parallel", "document_mask"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "float8_tensorwise"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "moe"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "qwen_qk_norm_bias"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "tied_embeddings"): ("parity-tested", "test_pairwise_matrix"),
    ("loss_parallel", "validation"): ("runs", "test_pairwise_matrix"),
    ("pp_1F1B", "ac_every_n"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "ac_full"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "ac_none"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "ac_selective_op"): ("parity-tested", "test_full_matrix"),
    ("pp_1F1B", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "compile"): ("parity-tested", "test_full_matrix"),
    ("pp_1F1B", "document_mask"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "float8_tensorwise"): ("runs", "test_pairwise_matrix"),
    ("pp_1F1B", "moe"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "qwen_qk_norm_bias"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_1F1B", "validation"): ("runs", "test_pairwise_matrix"),
    ("pp_DualPipeV", "ac_every_n"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "ac_full"): ("runs", "test_full_matrix"),
    ("pp_DualPipeV", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "document_mask"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("pp_DualPipeV", "moe"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "qwen_qk_norm_bias"): ("parity-tested", "test_full_matrix"),
    ("pp_DualPipeV", "validation"): ("runs", "test_full_matrix"),
    ("pp_GPipe", "ac_every_n"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "ac_selective_op"): ("runs", "test_full_matrix"),
    ("pp_GPipe", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "compile"): ("runs", "test_full_matrix"),
    ("pp_GPipe", "document_mask"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("pp_GPipe", "moe"): ("runs", "test_full_matrix"),
    ("pp_GPipe", "qwen_qk_norm_bias"): ("parity-tested", "test_full_matrix"),
    ("pp_GPipe", "validation"): ("runs", "test_full_matrix"),
    ("pp_Interleaved1F1B", "ac_every_n"): ("runs", "test_full_matrix"),
    ("pp_Interleaved1F1B", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "ac_selective_op"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "compile"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "document_mask"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("pp_Interleaved1F1B", "moe"): ("parity-tested", "test_full_matrix"),
    ("pp_Interleaved1F1B", "qwen_qk_norm_bias"): ("runs", "test_full_matrix"),
    ("pp_Interleaved1F1B", "validation"): ("runs", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "ac_every_n"): ("runs", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "document_mask"): ("parity-tested", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "moe"): ("parity-tested", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "qwen_qk_norm_bias"): ("runs", "test_full_matrix"),
    ("pp_InterleavedZeroBubble", "validation"): ("runs", "test_full_matrix"),
    ("pp_LoopedBFS", "ac_every_n"): ("runs", "test_full_matrix"),
    ("pp_LoopedBFS", "ac_full"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "ac_selective_op"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "activation_offload"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "compile"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "document_mask"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "float8_rowwise"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "float8_tensorwise"): ("runs", "test_full_matrix"),
    ("pp_LoopedBFS", "moe"): ("parity-tested", "test_full_matrix"),
    ("pp_LoopedBFS", "qwen_qk_norm_bias"): ("runs", "test_full_matrix"),
    ("pp_LoopedBFS", "validation"): ("runs", "test_full_matrix"),
    ("pp_ZBVZeroBubble", "ac_every_n"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "ac_full"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "ac_none"): ("parity-tested", "test_full_matrix"),
    ("pp_ZBVZeroBubble", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "document_mask"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "float8_tensorwise"): ("runs", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "moe"): ("parity-tested", "test_pairwise_matrix"),
    ("pp_ZBVZeroBubble", "qwen_qk_norm_bias"): ("parity-tested", "test_full_matrix"),
    ("pp_ZBVZeroBubble", "validation"): ("runs", "test_pairwise_matrix"),
    ("tp_sp", "ac_every_n"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "ac_full"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "ac_selective_op"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "activation_offload"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "compile"): ("parity-tested", "test_full_matrix"),
    ("tp_sp", "float8_rowwise"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "float8_tensorwise"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "moe"): ("parity-tested", "test_pairwise_matrix"),
    ("tp_sp", "tied_embeddings"): ("parity-tested", "test_pairwise_matrix"),
}


def merge(runs: list[dict[str, object]]) -> dict[str, tuple[str, str]]:
    """{"row|column": (status, test)} from the runs' JSON (``{"test", "cells": {"row|column": status}}``), CI's first:
    the stronger status wins, the earlier run on a tie."""
    out: dict[str, tuple[str, str]] = {}
    for run in runs:
        cells = run["cells"]
        assert isinstance(cells, dict)
        for key, status in cells.items():
            if key not in out or RANK[status] > RANK[out[key][0]]:
                out[key] = (status, str(run["test"]))
    return out


def render(cells: dict[str, tuple[str, str]]) -> str:
    """This module's source with ``cells`` as MEASURED."""
    text = Path(__file__).read_text()
    head, tail = text[: text.index("MEASURED: dict")], text[text.index("\n\n\ndef merge") :]
    body = "".join(
        f'    ("{k.split("|")[0]}", "{k.split("|")[1]}"): ("{s}", "{t}"),\n' for k, (s, t) in sorted(cells.items())
    )
    return (
        head + 'MEASURED: dict[tuple[str, str], tuple[Literal["parity-tested", "runs"], str]] = {\n' + body + "}" + tail
    )


if __name__ == "__main__":
    Path(__file__).write_text(render(merge([json.loads(Path(a).read_text()) for a in sys.argv[1:]])))
    print(f"wrote {__file__}")
