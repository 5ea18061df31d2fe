"""The composability rules at combinations where each degree differs, and the CP implementation's default read as
what it resolves to (issue 37: "rules tested at one combination"). A refusal must never tell the user to set the
value that is already set."""

from __future__ import annotations

import itertools
import re

import pytest

from meshforge.config.schema import Float8, Parallelism
from meshforge.errors import ConfigError
from meshforge.parallel import composability as table
from meshforge.parallel.context_parallel.api import resolve_cp_impl
from meshforge.parallel.dims import ParallelDims

DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
DISTINCT = dict(zip(DEGREES, (2, 3, 4, 5, 6, 7), strict=True))  # each axis its own size: a swapped axis shows


@pytest.mark.parametrize("on", list(itertools.product((False, True), repeat=len(DEGREES))))
def test_each_axis_turns_on_exactly_its_own_rows(on: tuple[bool, ...]) -> None:
    """Every on / off combination of the six axes, each at a size no other axis has: the rows are the hand list."""
    degrees = {axis: DISTINCT[axis] if flag else 1 for axis, flag in zip(DEGREES, on, strict=True)}
    want = [r for r, axis in (("fsdp", "dp_shard"), ("hsdp", "dp_replicate"), ("ep", "ep")) if degrees[axis] > 1]
    want += ["tp_sp", "loss_parallel"] if degrees["tp"] > 1 else []
    want += ["pp_1F1B"] if degrees["pp"] > 1 else []
    want += ["cp_allgather"] if degrees["cp"] > 1 else []
    got = table.active_parallelisms(Parallelism(), **degrees, cp_impl="auto")
    assert got == want, degrees


@pytest.mark.parametrize("impl", ["auto", "allgather", "ring"])
def test_the_cp_row_is_the_implementation_that_runs(impl: str) -> None:
    """context_parallel_impl's default 'auto' runs the all-gather (context_parallel/api.py): its row is that one."""
    rows = table.active_parallelisms(Parallelism(), dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=2, ep=1, cp_impl=impl)
    assert rows == [f"cp_{resolve_cp_impl(impl, 'cpu')}"]


@pytest.mark.parametrize("impl", ["auto", "allgather", "ring"])
def test_cp_with_compile_is_refused_only_for_the_ring_and_never_names_the_set_value_as_the_fix(impl: str) -> None:
    """Through training's own check (ParallelDims.check_composability), CP 2 with FSDP 3 and TP 4, compile on."""
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=3, cp=2, tp=4, ep=1)
    section = Parallelism(context_parallel_impl=impl)  # type: ignore[arg-type]
    if impl != "ring":
        dims.check_composability(section, compile_enabled=True, float8=Float8(), device_type="cpu")
        return
    with pytest.raises(ConfigError) as caught:
        dims.check_composability(section, compile_enabled=True, float8=Float8(), device_type="cpu")
    fix = str(caught.value).split("; use ", 1)[1]
    assert "ring" not in re.findall(r"'(\w+)'", fix), str(caught.value)
    assert "'allgather'" in fix
