"""Straggler detection's rule (observability/straggler.py), without processes."""

from __future__ import annotations

from typing import Any

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


def test_a_rank_is_named_after_three_consecutive_slow_intervals_only(monkeypatch: Any, capsys: Any) -> None:
    """The detector's streak (StragglerDetector.observe) on a scripted all-gather: a rank slow in 3 intervals with a
    healthy one between is never named; 3 in a row names it once on the console, and the flag is rank 0's."""
    import torch

    from meshforge.observability import straggler

    healthy = [0.01, 0.20, 0.05, 0.1]
    slow = [0.31, 0.20, 0.05, 0.0]
    script: list[list[list[float]]] = []  # per observe: every rank's [data, fwd_bwd, optimizer, wait, flag]

    class FakeDist:
        def is_initialized(self) -> bool:
            return True

        def get_world_size(self) -> int:
            return 3

        def all_gather(self, out: list[torch.Tensor], local: torch.Tensor) -> None:
            for tensor, row in zip(out, script.pop(0), strict=True):
                tensor.copy_(torch.tensor(row, dtype=tensor.dtype))

    monkeypatch.setattr(straggler, "dist", FakeDist())
    monkeypatch.setattr(straggler, "collective_tensor", lambda values: torch.tensor(values, dtype=torch.float64))
    detector = straggler.StragglerDetector(threshold=0.2, console=True)

    def interval(rank1_slow: bool, flag: float = 0.0) -> dict[str, Any]:
        script.append([[*healthy, flag], [*(slow if rank1_slow else healthy), 0.0], [*healthy, 0.0]])
        record, got = detector.observe(step=detector.gathers + 1, flag=0.0)
        assert got == flag, "the save flag must be rank 0's value"
        return record

    for rank1_slow in (True, True, False, True, True, False):  # never 3 in a row
        assert "stragglers" not in interval(rank1_slow), (
            f"named without {straggler.CONSECUTIVE} slow intervals in a row"
        )
    records = [interval(True, flag=1.0) for _ in range(4)]
    assert ["stragglers" in r for r in records] == [False, False, True, True], records
    assert records[2]["stragglers"] == [1] and records[2]["wait_max_s"] == 0.1
    assert detector.gathers == 10
    out = capsys.readouterr().out
    assert out.count("rank 1 at step 9, slow for 3 log intervals: data") == 1 and out.count("rank") == 1, out
