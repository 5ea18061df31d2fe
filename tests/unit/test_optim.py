"""The optimizer's implementation choice: auto is fused (it skips a non-finite step on the device), and every choice
takes the same steps (the same parameters after a few updates, to float32 rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshforge.config.io import ConfigError, load_config
from meshforge.config.schema import Optimizer
from meshforge.train.optim import build_optimizer, implementation


def test_auto_is_fused_and_each_name_sets_its_flag() -> None:
    assert implementation("auto") == {"foreach": False, "fused": True}
    assert implementation("for-loop") == {"foreach": False, "fused": False}
    assert implementation("foreach") == {"foreach": True, "fused": False}
    assert implementation("fused") == {"foreach": False, "fused": True}


def trained(how: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = build_optimizer([model], Optimizer(lr=1e-2, implementation=how))  # type: ignore[arg-type]
    for step in range(4):
        torch.manual_seed(100 + step)
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["foreach", "fused"])
def test_every_implementation_takes_the_same_steps(how: str) -> None:
    for a, b in zip(trained("for-loop"), trained(how), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_unknown_implementation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="implementation"):
        load_config(None, ["--optimizer.implementation", "magic"])


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_lr_warms_up_to_the_peak_and_decays_to_the_minimum_at_the_last_step(decay: str) -> None:
    from meshforge.train.optim import lr_factor

    def at(step: int) -> float:
        return lr_factor(step, warmup=4, total=20, decay=decay, min_factor=0.1)

    assert [at(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8] and at(4) == 1.0
    assert abs(at(20) - 0.1) < 1e-12, f"{decay} decay ends at {at(20)}, not min_lr_factor 0.1 at the last step"
    assert abs(at(12) - 0.55) < 1e-12  # halfway through the decay: (1 + 0.1) / 2 for both shapes
    assert at(30) == at(20)


@pytest.mark.parametrize("how", ["fused", "foreach"])
def test_step_unless_updates_nothing_on_a_set_flag_and_steps_on_a_clear_one(how: str) -> None:
    from meshforge.train.optim import step_unless

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = build_optimizer([model], Optimizer(lr=1e-2, implementation=how))  # type: ignore[arg-type]
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    step_unless(opt, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in opt.state.values())  # moments untouched
    step_unless(opt, torch.tensor(0.0))
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
