"""The chunked loss's refusals (model/chunked_loss.py, which the model floor keeps torch-side) say what the
composability table says: a layout is refused by one exactly when it is refused by the other."""

from __future__ import annotations

import itertools

import pytest

from meshforge.errors import ConfigError
from meshforge.model.chunked_loss import check_loss_chunks
from meshforge.parallel import composability


def table_refuses(tp: int, pp: int) -> bool:
    rows = (["tp_sp", "loss_parallel"] if tp > 1 else []) + (["pp_1F1B"] if pp > 1 else [])
    return composability.refusal(rows, ["loss_chunks"]) is not None


@pytest.mark.parametrize(("tp", "pp"), list(itertools.product([1, 2], [1, 2])))
def test_chunked_loss_refusals_match_the_table(tp: int, pp: int) -> None:
    try:
        check_loss_chunks(4, tp=tp, pp=pp)
        refused = False
    except ConfigError:
        refused = True
    assert refused == table_refuses(tp, pp), f"tp {tp} pp {pp}: check_loss_chunks and the table disagree"


def test_every_schedule_refuses_chunks() -> None:
    for name in composability.PARALLELISMS:
        if name.startswith("pp_"):
            assert composability.cell(name, "loss_chunks").status == "refused", name
