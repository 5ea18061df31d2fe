"""Straggler detection's rule (observability/straggler.py), without processes."""

from __future__ import annotations

from meshforge.observability.straggler import StepTimes, find_stragglers


def test_the_slow_part_of_one_rank_is_named_and_no_other_rank() -> None:
    # [data, fwd_bwd, optimizer, wait] seconds per step; rank 2's data loading takes 0.3 s more
    rows = [[0.01, 0.20, 0.05, 0.30], [0.01, 0.21, 0.05, 0.29], [0.31, 0.20, 0.05, 0.0], [0.02, 0.19, 0.05, 0.3]]
    slow = find_stragglers(rows, 0.2)
    assert list(slow) == [2] and slow[2].startswith("data"), slow


def test_below_the_threshold_nobody_is_named() -> None:
    rows = [[0.01, 0.20, 0.05, 0.1], [0.05, 0.20, 0.05, 0.06], [0.01, 0.21, 0.05, 0.1]]
    assert find_stragglers(rows, 0.2) == {}  # +0.04 s on a 0.36 s step is 11 %
    assert list(find_stragglers(rows, 0.1)) == [1]


def test_one_rank_has_no_straggler() -> None:
    assert find_stragglers([[1.0, 1.0, 1.0, 0.0]], 0.2) == {}


def test_step_times_split_wall_and_cpu() -> None:
    import time

    times = StepTimes()
    times.begin()
    time.sleep(0.05)  # data loading (no CPU)
    times.split(0.05)
    time.sleep(0.05)  # a wait in a collective: wall time, no CPU time
    times.end()
    data, fwd_bwd, optimizer, wait = times.per_step()
    assert data == 0.05 and fwd_bwd < 0.02 and optimizer < 0.02 and wait > 0.04
