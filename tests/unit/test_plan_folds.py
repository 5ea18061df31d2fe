"""The honest leave-one-out: each fold refits from the neutral start and never sees its row; the model it fits has no
kink; the cached folds are keyed on every file a prediction runs."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from meshforge.bench import predict as bench_predict
from meshforge.plan.accuracy import fit, folds, loo
from meshforge.plan.physics import comm
from meshforge.plan.physics import estimate as est_mod

pytestmark = pytest.mark.filterwarnings("ignore")

ONLY_THROUGH_LAYOUTS = {
    "__init__.py",
    "errors.py",
    "config/__init__.py",
    "config/io.py",
    "config/schema.py",
    "config/parallelism.py",
    "config/sections.py",
    "model/__init__.py",
    "model/hf_config.py",
    "parallel/__init__.py",
    "parallel/pipeline/__init__.py",
    "plan/__init__.py",
    "plan/accuracy/__init__.py",
    "plan/physics/__init__.py",
    "plan/accuracy/interval.py",
}
"""Modules importing the planner loads that reach a prediction only through the resolved layouts (which the key
hashes) or that compute no prediction (interval.py: spreads around one; the sub-packages' __init__.py: a docstring)."""


def test_cache_key_covers_every_module_on_the_prediction_path() -> None:
    """Whatever importing plan/accuracy/loo.py, plan/accuracy/calibrate.py and bench/predict.py loads from meshforge is
    hashed by the folds' and the bench's cache keys, or is listed above as reaching predictions only through the
    layouts."""
    code = (
        "import sys, json, meshforge.plan.accuracy.loo, meshforge.plan.accuracy.calibrate, meshforge.bench.predict;"
        "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() "
        "if n.startswith('meshforge') and getattr(m, '__file__', None))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = {str(p).split("/src/meshforge/", 1)[1] for p in json.loads(out)}
    hashed = set(folds.PREDICTION_SOURCES) | set(bench_predict.PREDICT_SOURCES)
    planner = {p for p in loaded if p.startswith(("plan/", "parallel/", "model/flavors"))}
    missing = sorted(p for p in planner - hashed - ONLY_THROUGH_LAYOUTS)
    assert not missing, f"on the prediction path but not in the cache key: {missing}"
    assert {"plan/physics/estimate.py", "plan/physics/memory.py", "plan/accuracy/fit.py", "plan/hardware.py"} <= hashed


def test_committed_folds_are_current() -> None:
    """The committed folds are those of the current physics and rows (else: python -m meshforge.plan.accuracy.folds)."""
    key = folds.cache_key(loo.observations())
    assert folds.read(folds.COMMITTED, key) is not None, (
        "stale: regenerate with `python -m meshforge.plan.accuracy.folds`"
    )


def test_a_fold_never_sees_its_row_and_moves_off_the_all_data_fit() -> None:
    """The fold that leaves out the row carrying most of attention's weight (the longest-context one) is fitted
    twice, once with that row's figure doubled: the constants are bit-identical (nothing of the left-out row reaches
    the fold: not its figure, not an all-data optimum as the start), and they differ from the all-data constants
    (the committed fit) by more than 2 % in attention, which the row pins down."""
    obs = loo.observations()
    key = "tt-2024-12.8b_cp_seq256k"
    doubled = [dataclasses.replace(o, tps_per_device=2 * o.tps_per_device) if o.name == key else o for o in obs]
    fold = loo.fold(obs, key)
    assert loo.fold(doubled, key).time.scale == fold.time.scale
    full = json.loads(folds.COMMITTED.read_text())["full"]["scale"]
    assert abs(math.log(fold.time.scale["attention"] / full["attention"])) > 0.02, (fold.time.scale, full)


def test_a_small_fold_is_blind_to_its_left_out_row() -> None:
    """The fast form of the test above (7 rows of one source, ~1 s instead of ~20 s): doubling the left-out row's
    figure leaves the fold's constants bit-identical, whether the row leaks in as a fitted row or through an
    all-data optimum as the fold's start; the row left in does move them (the check can see a change)."""
    rows = [o for o in loo.observations() if o.name.startswith("tt-2024-12.8b")]
    key = "tt-2024-12.8b_cp_seq256k"
    assert len(rows) == 7 and key in {o.name for o in rows}

    def doubled(name: str) -> list[fit.Observation]:
        return [dataclasses.replace(o, tps_per_device=2 * o.tps_per_device) if o.name == name else o for o in rows]

    fold = loo.fold(rows, key).time.scale
    assert loo.fold(doubled(key), key).time.scale == fold, "the left-out row reached its own fold"
    assert loo.fold(doubled("tt-2024-12.8b_cp_seq128k"), key).time.scale != fold


def test_exposed_communication_has_no_kink() -> None:
    """max(0, comm - hidden) smoothed: at comm = hidden the one-sided derivatives agree (a kink gives 0 and 1), and
    far from it the smooth form equals the max."""
    h = 1e-6
    right = (comm.exposed(1.0 + h, 1.0) - comm.exposed(1.0, 1.0)) / h
    left = (comm.exposed(1.0, 1.0) - comm.exposed(1.0 - h, 1.0)) / h
    assert right == pytest.approx(left, abs=0.01)
    assert comm.exposed(2.0, 1.0) == pytest.approx(1.0, rel=1e-6)
    assert comm.exposed(0.5, 1.0) == pytest.approx(0.0, abs=1e-6)


def test_the_fit_is_smooth_on_every_row() -> None:
    """At the all-data fit, every row's forward and backward derivatives of log tokens/s in each shared constant
    agree (the old model's A100 8B row: 0.25 against 0.54)."""
    v = folds.validation()
    names = ["matmul", "attention", "memory_bandwidth", "network"]
    for o in loo.observations():
        hw = v.fitted.profile_for(o)
        base = math.log(est_mod.estimate(o.layout, hw).tps_per_device)
        for n in names:
            up, down = (
                math.log(est_mod.estimate(o.layout, fit.scaled(hw, {n: math.exp(s)})).tps_per_device) - base
                for s in (1e-3, -1e-3)
            )
            assert up / 1e-3 == pytest.approx(-down / 1e-3, abs=0.05), (o.name, n)
