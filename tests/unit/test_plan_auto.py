"""`meshforge train --parallelism.auto` (plan/guide/auto.py): the search's fastest layout that the exact memory run
admits, spelled out as training flags; a layout the exact run says does not fit is never picked."""

from __future__ import annotations

import pytest

from meshforge.config.io import ConfigError, load_config
from meshforge.plan.guide import auto
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_from_config

ARGV = ["--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "8"]


def test_the_exact_run_refuses_and_the_next_layout_is_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    hw = load_hardware("h100")
    calls: list[str] = []

    def exact(cfg: object, world: int) -> float:
        calls.append(layout_from_config(cfg, world).describe())  # type: ignore[arg-type]
        return 1000.0 if len(calls) == 1 else 1.0  # the fastest one "does not fit"

    monkeypatch.setattr(auto, "exact_peak_gib", exact)
    p = auto.pick(ARGV, None, 4, hw)
    assert len(calls) == 2 and p.refused[0][0] == calls[0]
    assert p.chosen.layout.describe() == calls[1] != calls[0]
    cfg = load_config(None, [*ARGV, "--parallelism.tensor_parallel_degree", "2", *p.flags])
    picked = layout_from_config(cfg, 4)  # the flags spell every degree: the user's TP 2 does not survive
    assert (picked.dp_shard, picked.tp, picked.pp, picked.cp) == tuple(
        getattr(p.chosen.layout, k) for k in ("dp_shard", "tp", "pp", "cp")
    )
    assert "refused by the exact memory run" in auto.explain(p, 4, hw)


def test_nothing_fits_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "exact_peak_gib", lambda cfg, world: 1000.0)
    with pytest.raises(ConfigError, match="do not fit by the exact memory run"):
        auto.pick(ARGV, None, 4, load_hardware("h100"))


def test_the_real_exact_run_admits_the_pick() -> None:
    """Unpatched: the fake-tensor step of the picked layout really runs and its peak is within the device."""
    p = auto.pick(ARGV, None, 2, load_hardware("h100"))
    assert 0 < p.exact_gib < p.usable_gib
    assert auto.resolve_train_argv(["--nproc", "2", *ARGV]) == ["--nproc", "2", *ARGV]  # no flag: unchanged
