"""tokens/s per device under a model-parallel layout: the ranks of one model replica (cp x tp x pp of them) read the
same tokens, so the logged throughput divides the interval's tokens by the elapsed time and by that count."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from meshforge.observability import metrics
from meshforge.observability.metrics import Interval, MetricsLogger


def test_tokens_per_second_divide_by_the_non_data_parallel_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    m = MetricsLogger(
        dump_folder=str(tmp_path),
        rank=0,
        console=False,
        flops_per_token=6e6,
        peak_flops=1e12,
        peak_source="test",
        non_dp_size=4,  # e.g. tp 2 x pp 2
        device=torch.device("cpu"),
        tensorboard=False,
    )
    m.start(0)
    m.interval = Interval(start=now[0])  # the interval starts on the patched clock
    m.add_tokens(8000, data_seconds=0.5)
    now[0] += 2.0
    record = m.log(1, torch.tensor(2.0), torch.tensor(1.0), 1e-3)
    assert math.isclose(record["step_time_s"], 2.0)
    assert math.isclose(record["tps"], 8000 / 2.0 / 4), (
        f"tokens/s {record['tps']} != 8000 tokens / 2 s / 4 non-data-parallel ranks = 1000: the divisor is missing"
    )
    assert math.isclose(record["tflops"], 6e6 * 1000 / 1e12) and math.isclose(record["mfu_pct"], 0.6)
    assert math.isclose(record["data_loading_pct"], 25.0)
