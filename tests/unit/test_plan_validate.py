"""The planner out of sample: the honest leave-one-out over every published row (plan/accuracy/published.py), and the
shipped constants, spreads and covariance are what that fit gives (a physics change without a refit fails here)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from meshforge.plan import shipped
from meshforge.plan.accuracy import fit, folds, interval, loo, loo_report
from meshforge.plan.hardware import load_hardware

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def validation() -> folds.Validation:
    return folds.validation()


def test_leave_one_out_accuracy(validation: folds.Validation, capsys: pytest.CaptureFixture[str]) -> None:
    """Honest LOO median <= 8 % tokens/s, <= 8 % memory; no published run predicted as not fitting."""
    with capsys.disabled():
        print("\n" + loo_report.format_validation(validation))
    s = loo.summary(validation.loo)
    assert s["tps_rows"] >= 30 and s["memory_rows"] >= 20
    assert s["tps_median"] <= 0.08
    assert s["memory_median"] <= 0.08
    for pred in validation.loo:
        assert loo_report.row_interval(pred, validation).verdict != "does not fit", pred.key  # every run ran


def test_loo_is_not_in_sample(validation: folds.Validation) -> None:
    """Leaving a row out moves many predictions by more than half a point (the old refit moved one), and on
    average makes them worse."""
    moved = [
        abs(a.estimate.tps_per_device / b.estimate.tps_per_device - 1)
        for a, b in zip(validation.loo, validation.in_sample, strict=True)
    ]
    assert sum(m > 0.005 for m in moved) >= 10, sorted(moved)
    assert loo.summary(validation.loo)["tps_log_sd"] > loo.summary(validation.in_sample)["tps_log_sd"]


def test_every_fold_starts_neutral_and_differs(validation: folds.Validation) -> None:
    """No fold's constants equal the all-data ones (each is its own fit), and the neutral start is no fit's."""
    full = validation.fitted.time.scale
    for key, fold in validation.folds.items():
        assert fold.start.efficiency == loo.NEUTRAL, key
        assert any(abs(math.log(s / full[n])) > 1e-4 for n, s in fold.time.scale.items() if n in full), key


def test_shipped_constants_are_the_fit(validation: folds.Validation) -> None:
    """plan/shipped.py (the Efficiency defaults, the family factors and spreads, the covariance, the paired spread)
    is this validation's (rounded)."""
    want = loo_report.shipped_values(validation)
    for name, value in want["REFERENCE"].items():  # type: ignore[attr-defined]
        assert shipped.REFERENCE[name] == pytest.approx(value, rel=0.01, abs=0.002), name
    assert set(shipped.FAMILIES) == set(want["FAMILIES"])  # type: ignore[arg-type]
    for fam, values in want["FAMILIES"].items():  # type: ignore[attr-defined]
        for name, value in values.items():
            assert shipped.FAMILIES[fam][name] == pytest.approx(value, rel=0.01, abs=0.002), (fam, name)
    for name, value in want["UNSEEN"].items():  # type: ignore[attr-defined]
        assert shipped.UNSEEN[name] == pytest.approx(value, abs=0.002), name
    assert tuple(shipped.COVARIANCE_NAMES) == tuple(want["COVARIANCE_NAMES"])  # type: ignore[arg-type]
    np.testing.assert_allclose(np.array(shipped.COVARIANCE), np.array(want["COVARIANCE"]), atol=0.002)
    assert abs(shipped.DIFF_LOG_SD - float(want["DIFF_LOG_SD"])) <= 0.002  # type: ignore[arg-type]
    assert abs(shipped.SOURCE_LOG_SD - float(want["SOURCE_LOG_SD"])) <= 0.002  # type: ignore[arg-type]
    assert abs(shipped.SOURCE_COVERAGE - float(want["SOURCE_COVERAGE"])) <= 0.01  # type: ignore[arg-type]


def test_presets_carry_their_family_constants() -> None:
    """Each GPU generation carries its own constants and spread: a family the rows determine gets its factor on
    matmul and attention and its own spread, one no row measured (gb200) the shared constants with a spread wider by
    the family prior."""
    ref = load_hardware(loo.REFERENCE).efficiency
    unseen = load_hardware("gb200").efficiency
    assert unseen.matmul == ref.matmul
    assert unseen.tps_log_sd == pytest.approx(math.hypot(ref.tps_log_sd, loo.FAMILY_PRIOR_SD), abs=0.002)
    a100 = load_hardware("a100").efficiency
    assert a100.matmul == pytest.approx(ref.matmul * shipped.FAMILIES["a100"]["factor"])
    assert a100.tps_log_sd == shipped.FAMILIES["a100"]["tps_log_sd"] >= shipped.SOURCE_LOG_SD  # a new source's
    assert a100.memory_log_sd == shipped.FAMILIES["a100"]["memory_log_sd"] != ref.memory_log_sd


def test_intervals_hold_their_nominal_coverage(validation: folds.Validation) -> None:
    """The reference family's +-1 sd holds its honest leave-one-out errors about as often as it says (68 %)."""
    cover = loo_report.coverage(validation)
    assert 0.55 <= cover[loo.REFERENCE]["tps_inside"] <= 0.85, cover
    assert 0.5 <= cover[loo.REFERENCE]["memory_inside"] <= 0.9, cover


def test_separable_is_a_test_of_the_difference() -> None:
    """separable(a, b, hw=...) tests log(b / a) against the spread of a predicted ratio (the published rows' paired
    leave-one-out errors plus the part of the constants' covariance that does not cancel), not b against a's own
    interval: a layout is never separable from itself, Float8 + async TP against Float8 alone (a 5-15 % gap) is not,
    and 70B against 8B (a factor of 7) is."""
    hw = load_hardware(loo.REFERENCE)
    obs = {o.name: o for o in loo.observations()}
    a = loo.predict(obs["tt-asynctp.70b_fp8"], hw).estimate
    b = loo.predict(obs["tt-asynctp.70b_fp8_async"], hw).estimate
    sd = interval.difference_sd(a, b, hw)
    assert shipped.DIFF_LOG_SD <= sd < shipped.DIFF_LOG_SD + 0.05
    assert interval.difference_sd(a, a, hw) == pytest.approx(shipped.DIFF_LOG_SD)
    assert not interval.separable(a, a, hw=hw) and not interval.separable(a, b, hw=hw)
    assert interval.separable(a, loo.predict(obs["table1.fsdp"], hw).estimate, hw=hw)


def test_fit_reports_standard_errors_and_drops_what_no_run_moves() -> None:
    """A constant no run depends on (network, with single-device runs) is dropped with the reason; the others get a
    finite standard error and their determining runs."""
    hw = load_hardware("h100")
    obs = [o for o in loo.observations() if o.layout.world_size == 8 and o.hardware and o.hardware.name == "h100"]
    single = [fit.Observation(o.name, dataclasses.replace(o.layout, dp_shard=1), o.tps_per_device, None) for o in obs]
    result = fit.fit_time(single, hw, ["matmul", "network"])
    assert ("network", "no run moves it") in result.dropped
    (matmul,) = result.constants
    assert matmul.name == "matmul" and 0 < matmul.log_se < 1 and matmul.determined_by
