"""The cells the covering-array matrix test proves (tests/distributed/test_composability_matrix.py): regenerated from
its run (``MESHFORGE_MATRIX_OUT=cells.json`` then ``python -m meshforge.parallel.composability_measured cells.json``);
the test fails when this table claims more, or less, than the run shows. Torch-free."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

MATRIX_TEST = "tests/distributed/test_composability_matrix.py::test_pairwise_matrix"

MEASURED: dict[tuple[str, str], Literal["parity-tested", "runs"]] = {}


def render(cells: dict[str, str]) -> str:
    """This module's source with ``cells`` ({"row|column": status}) as MEASURED."""
    text = Path(__file__).read_text()
    head, tail = text[: text.index("MEASURED: dict")], text[text.index("\n\n\ndef render") :]
    body = "".join(f'    ("{k.split("|")[0]}", "{k.split("|")[1]}"): "{v}",\n' for k, v in sorted(cells.items()))
    return head + 'MEASURED: dict[tuple[str, str], Literal["parity-tested", "runs"]] = {\n' + body + "}" + tail


if __name__ == "__main__":
    Path(__file__).write_text(render(json.loads(Path(sys.argv[1]).read_text())["cells"]))
    print(f"wrote {__file__}")
