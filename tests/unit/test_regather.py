"""gradient_sync.regather = auto in training (train/regather.py): after the first step, keep the parameters gathered
between micro-steps only where the reserved peak plus the gathered bytes (at the measured fragmentation) plus the
memory outside the allocator fit the device on every rank; the planner decides with the same rule
(device/memory_budget.py ``fits``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshforge.config.io import load_config
from meshforge.device import memory_budget
from meshforge.train import regather

GIB = 2**30


def readings(reserved: float, allocated: float, outside: float = 0.0, capacity: float = 80) -> regather.Readings:
    return regather.Readings(int(reserved * GIB), int(allocated * GIB), int(outside * GIB), int(capacity * GIB))


def test_the_budget_is_the_reserved_peak_the_fragmented_addition_and_the_reserve_outside() -> None:
    """80 GiB device. Reserved 60 of allocated 50 (slack 0.2): 10 GiB of parameters take 12 once allocated; 1.5 GiB
    is the least reserve outside the allocator (context, NCCL), more when more is measured there."""
    assert memory_budget.RUNTIME_GIB == 1.5
    room = int((80 - 60 - 1.5) / 1.2 * GIB)
    assert regather.keep_fits(readings(60, 50), room) and not regather.keep_fits(readings(60, 50), room + 1024)
    # fragmentation counts: the allocated peak alone (50 + 10 + 1.5) would fit, the reserved one does not
    assert not regather.keep_fits(readings(68, 50), 10 * GIB)
    assert regather.keep_fits(readings(50, 50), 10 * GIB)
    # memory outside the allocator (context, communicators, another process): measured 6 GiB, not the 1.5 assumed
    assert regather.keep_fits(readings(60, 60, outside=1), 18 * GIB)
    assert not regather.keep_fits(readings(60, 60, outside=6), 18 * GIB)


def test_training_and_the_planner_budget_with_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both call device/memory_budget.py fits: a stricter rule there changes both decisions."""
    from meshforge.plan.hardware import HardwareSpec
    from meshforge.plan.physics import peak

    assert HardwareSpec.__dataclass_fields__["runtime_gib"].default == memory_budget.RUNTIME_GIB
    calls: list[str] = []
    real = memory_budget.fits
    monkeypatch.setattr(memory_budget, "fits", lambda *a: calls.append("fits") or real(*a))
    monkeypatch.setattr(regather, "fits", memory_budget.fits)
    regather.keep_fits(readings(10, 10), GIB)
    assert calls == ["fits"]
    lay, args, hw = plan_layout()
    peak.resolve_gradient_sync(args, lay, hw)
    assert len(calls) > 1


def plan_layout():  # type: ignore[no-untyped-def]
    from meshforge.plan.hardware import load_hardware
    from meshforge.plan.layout import layout_args, layout_from_config

    lay = layout_from_config(cfg("--training.device", "cuda", "--gradient_sync.mode", "once_per_step"), 8)
    return lay, layout_args(lay), load_hardware("h100")


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


@pytest.mark.parametrize(("reserved_gib", "keep"), [(40, True), (77, False)])
def test_on_cuda_the_decision_reads_the_device(monkeypatch: pytest.MonkeyPatch, reserved_gib: int, keep: bool) -> None:
    """The CUDA path with the device's readings stubbed (this machine has no GPU): 1 GiB of bf16 parameters; 40 GiB
    reserved of 32 allocated (slack 0.25); the device says 2 GiB in use beyond the reservation (context, NCCL)."""
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: reserved_gib * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: reserved_gib * GIB * 4 // 5)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (48 * GIB, 80 * GIB))  # 80 - 48 - 30 = 2 outside
    model = nn.Linear(1024, 512 * 1024, bias=False, device="meta")  # 2**29 parameters: 1 GiB in bf16
    got, why = regather.decide_keep([model], torch.device("cuda"), "bfloat16")
    assert got is keep
    want = f"reserved peak {reserved_gib}.0 GiB + gathered 1.0 GiB x 1.25 (fragmentation) + 2.0 GiB outside the"
    assert want in why and "vs 80.0 GiB" in why
    assert ("keep from the next step" in why) is keep
    again, why = regather.decide_keep([model], torch.device("cuda"), "bfloat16", kept=True)  # re-decided while kept
    assert "gathered 0.0 GiB" in why and again is (reserved_gib + 2 <= 80)
