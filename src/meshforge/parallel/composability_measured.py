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

MEASURED: dict[tuple[str, str], tuple[Literal["parity-tested", "runs"], str]] = {}


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
