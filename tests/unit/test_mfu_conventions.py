"""MFU in both conventions (issue 46.5): TorchTitan's (attention counted in full, 12 x L x H x Q x T) and the causal
one (attention halved, Megatron-Bridge's); only the attention term is halved, never the 6 x parameters."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from meshforge.cli import main
from meshforge.model.flavors import (
    ModelArgs,
    attention_flops_per_token,
    causal_flops_per_token,
    flops_per_token,
    get_flavor,
)
from meshforge.observability.metrics import Interval, MetricsLogger

TINY = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=16, use_scaled_rope=False)
SEQ = 10
# by hand, head_dim 8 / 2 = 4: per layer wq 8x8 + wk, wv 2 x 8x4 + wo 8x8 = 192, SwiGLU 3 x 8 x 16 = 384, two norms
# 16 -> 592; non-embedding = 2 x 592 + final norm 8 + output 8 x 16 = 1,320 -> 6 x 1,320 = 7,920
DENSE_FLOPS = 7920
ATTENTION_FLOPS = 12 * 2 * 2 * 4 * SEQ  # 1,920


def test_hand_computed_flops_per_token_in_both_conventions() -> None:
    assert attention_flops_per_token(TINY, SEQ) == ATTENTION_FLOPS
    assert flops_per_token(TINY, SEQ) == DENSE_FLOPS + ATTENTION_FLOPS  # 9,840
    assert causal_flops_per_token(TINY, SEQ) == DENSE_FLOPS + ATTENTION_FLOPS / 2, (
        f"causal FLOPs {causal_flops_per_token(TINY, SEQ)} != 7,920 + 1,920 / 2 = 8,880: only attention is halved"
    )


def test_the_metrics_record_carries_both_mfus(tmp_path: Path) -> None:
    m = MetricsLogger(
        dump_folder=str(tmp_path),
        rank=0,
        console=False,
        flops_per_token=flops_per_token(TINY, SEQ),
        flops_per_token_causal=causal_flops_per_token(TINY, SEQ),
        peak_flops=1e9,
        peak_source="test",
        non_dp_size=1,
        device=torch.device("cpu"),
        tensorboard=False,
    )
    m.start(0)
    m.interval = Interval(start=m.interval.start)
    m.add_tokens(1000, data_seconds=0.0)
    record = m.log(1, torch.tensor(2.0), torch.tensor(1.0), 1e-3)
    assert math.isclose(record["mfu_causal_pct"] / record["mfu_pct"], 8880 / 9840)
    written = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert written["mfu_causal_pct"] == record["mfu_causal_pct"] and "mfu_pct" in written


def test_the_planner_prints_both_mfus_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    job = ["--model.flavor", "1B", "--training.seq_len", "8192", "--training.local_batch_size", "2"]
    assert main(["plan", *job, "--world-size", "1", "--hardware", "h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    args = get_flavor("1B")
    ratio = causal_flops_per_token(args, 8192) / flops_per_token(args, 8192)
    assert data["mfu_causal_pct"] == pytest.approx(data["mfu_pct"] * ratio, abs=0.02)
    assert main(["plan", *job, "--world-size", "1", "--hardware", "h100"]) == 0
    text = capsys.readouterr().out
    assert "MFU (TorchTitan convention, attention counted in full)" in text
    assert "MFU (causal, attention halved, Megatron-Bridge convention)" in text
