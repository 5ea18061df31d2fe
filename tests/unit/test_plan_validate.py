"""The planner out of sample: leave-one-out over every published row (plan/published.py), and the shipped constants,
spreads and covariance are what that fit gives (a physics change without a refit fails here)."""

from __future__ import annotations

import numpy as np
import pytest

from meshforge.plan import fit, interval, validate
from meshforge.plan.hardware import Efficiency, load_hardware

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def validation() -> validate.Validation:
    return validate.validation()


def test_leave_one_out_accuracy(validation: validate.Validation, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's bar: LOO median <= 15 % tokens/s, <= 10 % memory; no published run predicted as not fitting."""
    with capsys.disabled():
        print("\n" + validate.format_validation(validation))
    s = validate.summary(validation.loo)
    assert s["tps_rows"] >= 30 and s["memory_rows"] >= 20
    assert s["tps_median"] <= 0.15
    assert s["memory_median"] <= 0.10
    for pred in validation.loo:
        verdict = validate.row_interval(pred, validation.fitted.profile).verdict
        assert verdict != "does not fit", pred.key  # every published run ran


def test_loo_is_not_in_sample(validation: validate.Validation) -> None:
    """Leaving a row out changes its prediction (the fit really is redone), and on average makes it worse."""
    moved = [
        abs(a.estimate.tps_per_device / b.estimate.tps_per_device - 1)
        for a, b in zip(validation.loo, validation.in_sample, strict=True)
    ]
    assert max(moved) > 1e-3
    assert validate.summary(validation.loo)["tps_log_sd"] >= validate.summary(validation.in_sample)["tps_log_sd"]


def test_shipped_constants_are_the_fit(validation: validate.Validation) -> None:
    """The defaults in hardware.Efficiency, the spreads and interval.COVARIANCE are this fit's (rounded)."""
    fitted = validation.fitted
    for c in fitted.time.constants:
        assert c.multiplier == pytest.approx(1.0, abs=max(0.01, 0.2 * c.log_se)), c.name
        assert c.determined_by, c.name
    assert [n for n, _ in fitted.time.dropped] == ["async_tp_overlap"]
    assert tuple(fitted.time.names) == interval.COVARIANCE_NAMES
    np.testing.assert_allclose(fitted.time.covariance, np.array(interval.COVARIANCE), atol=0.01)
    eff = Efficiency()
    assert fitted.memory.allocator_overhead == pytest.approx(eff.allocator_overhead, abs=0.002)
    assert fitted.memory.framework_gib == eff.framework_gib == 0.0 and fitted.memory.merged
    s = validate.summary(validation.loo)
    assert s["tps_log_sd"] == pytest.approx(eff.tps_log_sd, abs=0.005)
    assert s["memory_log_sd"] == pytest.approx(eff.memory_log_sd, abs=0.005)


def test_fit_reports_standard_errors_and_drops_what_no_run_moves() -> None:
    """A constant no run depends on (network, with single-device runs) is dropped with the reason; the others get a
    finite standard error and their determining runs."""
    hw = load_hardware("h100")
    obs = [o for o in validate.observations() if o.layout.world_size == 8 and o.hardware and o.hardware.name == "h100"]
    single = [
        fit.Observation(o.name, o.layout.__class__(**{**o.layout.__dict__, "dp_shard": 1}), o.tps_per_device, None)
        for o in obs
    ]
    result = fit.fit_time(single, hw, ["matmul", "network"])
    assert ("network", "no run moves it") in result.dropped
    (matmul,) = result.constants
    assert matmul.name == "matmul" and 0 < matmul.log_se < 1 and matmul.determined_by
