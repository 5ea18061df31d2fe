"""The optimizer's implementation choice: auto is foreach, and every choice takes the same steps (the same
parameters after a few updates, to float32 rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshforge.config.io import ConfigError, load_config
from meshforge.config.schema import Optimizer
from meshforge.train.optim import build_optimizer, implementation


def test_auto_is_foreach_and_each_name_sets_its_flag() -> None:
    assert implementation("auto") == {"foreach": True, "fused": False}
    assert implementation("for-loop") == {"foreach": False, "fused": False}
    assert implementation("auto") == {"foreach": True, "fused": False}
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
