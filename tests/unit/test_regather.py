"""gradient_sync.regather = auto in training (train/regather.py): after the first step, keep the parameters gathered
between micro-steps only where the measured peak plus the gathered bytes fit the device on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshforge.config.io import load_config
from meshforge.train import regather

GIB = 2**30


def test_fits_is_the_measured_peak_plus_the_gathered_bytes_within_the_headroom() -> None:
    cap = 80 * GIB
    assert regather.fits(60 * GIB, 12 * GIB, cap)  # 72 <= 0.9 x 80
    assert not regather.fits(60 * GIB, 12 * GIB + 1, cap)
    assert not regather.fits(73 * GIB, 0, cap)


def test_gathered_bytes_of_plain_parameters_are_their_size_in_the_compute_dtype() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2, bias=False))
    assert regather.gathered_bytes([model], torch.bfloat16) == (8 * 4 + 4 + 4 * 2) * 2
    assert regather.gathered_bytes([model, model], torch.float32) == 2 * (8 * 4 + 4 + 4 * 2) * 4


def cfg(*extra: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["--training.gradient_accumulation_steps", "4", *extra])


def test_only_auto_under_one_exchange_per_step_with_fsdp_is_decided(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(4, 4)
    cpu = torch.device("cpu")
    assert not regather.auto_keep(cfg(), [model], cpu, fsdp_without_pp=True)
    assert "reshard (no device memory to budget on a CPU)" in capsys.readouterr().out
    for c, fsdp in ((cfg("--gradient_sync.regather", "reshard"), True), (cfg(), False)):
        assert not regather.auto_keep(c, [model], cpu, fsdp_without_pp=fsdp)
    no_accumulation = load_config(None, [])
    assert not regather.auto_keep(no_accumulation, [model], cpu, fsdp_without_pp=True)
    assert capsys.readouterr().out == ""  # not decided here: nothing said


@pytest.mark.parametrize(("peak_gib", "keep"), [(40, True), (72, False)])
def test_on_cuda_the_decision_reads_the_peak_and_the_capacity(
    monkeypatch: pytest.MonkeyPatch, peak_gib: int, keep: bool
) -> None:
    """The CUDA path with the device's two readings stubbed (this machine has no GPU): 1 GiB of bf16 parameters."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak_gib * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 80 * GIB))
    model = nn.Linear(1024, 512 * 1024, bias=False)  # 2**29 parameters: 1 GiB in bf16
    got, why = regather.decide_keep([model], torch.device("cuda"), "bfloat16")
    assert got is keep
    assert f"peak {peak_gib}.0 GiB + gathered 1.0 GiB vs 90% of 80.0 GiB" in why
    assert ("keep from the next step" in why) is keep
