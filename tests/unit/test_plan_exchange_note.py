"""The text report's one line on an exposed FSDP exchange under gradient accumulation (plan/report.py
exchange_note): the issue's 8B layout on 128 H100 is not within 10 % of one node by default, so the report says what
is still exposed and why, and names the switch that hides it; a layout without the exposure says nothing."""

from __future__ import annotations

from meshforge.config.io import load_config
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import Estimate, estimate
from meshforge.plan.report import exchange_note, format_estimate
from tests.unit.test_plan_gradient_sync import EIGHT_B


def est(world: int, *extra: str) -> Estimate:
    return estimate(layout_from_config(load_config(None, [*EIGHT_B, *extra]), world), load_hardware("h100"))


def test_the_exposed_regather_is_named_with_its_switch() -> None:
    e = est(128, "--gradient_sync.regather", "reshard")
    line = exchange_note(e)
    assert line.startswith(f"exposed: FSDP {e.time['exposed_fsdp_comm']:.2f} s of {e.step_time:.2f} s"), line
    assert "re-gathered for every micro-step" in line and "--gradient_sync.regather keep" in line
    assert "at more memory" in line
    assert line in format_estimate(e, load_hardware("h100")).splitlines()


def test_regather_auto_keeps_here_so_nothing_is_exposed() -> None:
    """The default (auto) keeps the parameters gathered where that fits: the report says so and notes nothing."""
    e = est(128)
    assert e.sync == ("once_per_step", "keep") and exchange_note(e) == ""
    text = format_estimate(e, load_hardware("h100")).splitlines()
    assert "gradient sync: once per step, parameters kept gathered between micro-steps" in text[2], text[2]


def test_the_per_micro_step_reduce_scatter_is_named_as_such() -> None:
    line = exchange_note(est(128, "--gradient_sync.mode", "every_microstep"))
    assert "reduce-scattered every micro-step" in line and "once_per_step" in line


def test_no_note_where_nothing_is_exposed_or_nothing_accumulates() -> None:
    assert exchange_note(est(8)) == ""  # one node: the exchange hides behind compute
    no_accumulation = est(128, "--training.gradient_accumulation_steps", "1", "--training.local_batch_size", "32")
    assert exchange_note(no_accumulation) == ""
    assert exchange_note(est(128, "--gradient_sync.regather", "keep")) == ""  # 2.4 s of 27 s: under the share
