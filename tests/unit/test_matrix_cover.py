"""The composability matrix's covering array (tests/matrix_cover.py): every allowed pair of factor values is in a job,
no job holds a forbidden pair (so no job runs through a refused cell), and every refused cell has its own job."""

from __future__ import annotations

import matrix_cover as mc
import pytest

from meshforge.parallel import composability as table


@pytest.fixture(scope="module")
def jobs() -> list[mc.Job]:
    return mc.cover(2)


def test_every_allowed_pair_is_in_a_job(jobs: list[mc.Job]) -> None:
    covered = set().union(*(mc.tuples_of(j, 2) for j in jobs))
    assert mc.required(2) <= covered
    assert len(jobs) <= 60  # greedy: a little above the 13 layouts x 4 AC modes a pairwise cover needs at least


def test_no_job_holds_a_forbidden_pair_or_a_refused_cell(jobs: list[mc.Job]) -> None:
    for job in jobs:
        assert set(job) == set(mc.FACTORS) and mc.allowed(job), job
        assert all(table.cell(*c).status != "refused" for c in mc.cells(job)), job


def test_every_reachable_table_cell_is_in_a_job_or_refused(jobs: list[mc.Job]) -> None:
    reached = {c for j in jobs for c in mc.cells(j)}
    refused = {c for c, _ in mc.refusal_jobs()}
    for layout, rows in mc.ROWS.items():
        for factor, values in mc.FACTORS.items():
            for value in values:
                if mc.forbidden(("layout", layout), (factor, value)) and factor != "model":
                    continue
                cells = {(r, c) for r in rows for c in mc.columns(factor, value)}
                assert cells <= reached | refused or factor == "model", (layout, factor, value)


def test_each_refused_cell_has_one_job_that_reaches_it() -> None:
    wanted = {
        k
        for k, c in table.CELLS.items()
        if c.status == "refused" and k[0] in {r for rs in mc.ROWS.values() for r in rs}
    }
    got = dict(mc.refusal_jobs())
    assert {k for k in got if "+" not in k[1]} == wanted
    for cell, job in got.items():
        assert cell in mc.cells(job) or mc.interaction(job) is not None, (cell, job)
    assert len(got) - len(wanted) == len(table.INTERACTIONS)  # one job per three-way refusal too


def test_a_three_wise_cover_holds_every_triple() -> None:
    jobs = mc.cover(3, tries=4)
    covered = set().union(*(mc.tuples_of(j, 3) for j in jobs))
    assert mc.required(3) <= covered and all(mc.allowed(j) for j in jobs)
