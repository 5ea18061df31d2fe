"""gradient_sync.mode = auto is one rule (parallel/accumulation.py) that training (train/grad_accum.py, after its
first step) and the planner (plan/physics/peak.py) both apply: on the same inputs they decide the same, across the
fit boundary; and the inputs mean the same: training's unsharded gradient bytes of the parallelized model (meta
device, fake process group) equal the planner's accumulated term for that layout, in the accumulation dtype."""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakeworld import BASE, parallelized

from meshforge.config.io import load_config
from meshforge.parallel.accumulation import Budget, Need, once_fits, resolve_mode
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_args, layout_from_config
from meshforge.plan.physics import peak
from meshforge.plan.physics.parts import rank_parts
from meshforge.train import grad_accum

GIB = 2**30
BUDGET = Budget(capacity=80 * GIB, reserve=2 * GIB, slack=0.05)
# (gradients, rest) around the boundary (rest + gradients) x 1.05 + 2 GiB = 80 GiB: 74.2857 GiB allocated
CASES = [(30 * GIB, 40 * GIB), (30 * GIB, 44.28 * GIB), (30 * GIB, 44.29 * GIB), (0.0, 74.2 * GIB), (1.0, 90 * GIB)]
CASES += [(30 * GIB, 46 * GIB)]  # fits only where the slack is ignored


def planner(need: Need, budget: Budget, monkeypatch: pytest.MonkeyPatch) -> str:
    """The planner's mode for an auto 8B layout whose inputs are ``need`` and ``budget``."""
    cfg = load_config(None, ["--model.flavor", "8B", "--training.gradient_accumulation_steps", "4"])
    layout = dataclasses.replace(layout_from_config(cfg, 8), regather="reshard")
    monkeypatch.setattr(peak, "accumulation_inputs", lambda *_: (need, budget))
    return peak.resolve_gradient_sync(layout_args(layout), layout, load_hardware("h100")).gradient_sync


def training(need: Need, budget: Budget, monkeypatch: pytest.MonkeyPatch) -> str:
    """Training's mode after its first step measured ``need`` and ``budget`` (one process: no collective)."""
    cfg = load_config(None, ["--training.gradient_accumulation_steps", "4"])
    state = SimpleNamespace(
        cfg=cfg, ctx=SimpleNamespace(device=torch.device("cpu")), dims=SimpleNamespace(fsdp_enabled=False)
    )
    monkeypatch.setattr(grad_accum, "measured", lambda *_: (need, budget))
    once, _ = grad_accum.decide(state, fresh=False)  # type: ignore[arg-type]
    return "once_per_step" if once else "every_microstep"


@pytest.mark.parametrize("gradients,rest", CASES)
def test_training_and_the_planner_decide_alike(gradients: float, rest: float, monkeypatch: pytest.MonkeyPatch) -> None:
    need = Need(gradients, rest)
    want = "once_per_step" if once_fits(need, BUDGET) else "every_microstep"
    assert planner(need, BUDGET, monkeypatch) == want, "the planner does not decide by parallel/accumulation.py"
    assert training(need, BUDGET, monkeypatch) == want, "training does not decide by parallel/accumulation.py"


def test_the_rule() -> None:
    assert [once_fits(Need(g, r), BUDGET) for g, r in CASES] == [True, True, False, True, False, False]
    assert resolve_mode("every_microstep", 8, pipeline=False) == "every_microstep"
    assert resolve_mode("auto", 1, pipeline=False) == "every_microstep"
    assert resolve_mode("auto", 8, pipeline=True) == "once_per_step", "a pipeline holds its gradients anyway"
    with pytest.raises(ValueError, match="decided by memory"):
        resolve_mode("auto", 8, pipeline=False)
    source = Path(peak.__file__).parents[2] / "parallel" / "accumulation.py"
    imports = [line for line in source.read_text().splitlines() if line.startswith(("import ", "from "))]
    assert not [i for i in imports if "torch" in i], "parallel/accumulation.py must stay torch-free (plan imports it)"


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["--training.mixed_precision_param", "bfloat16"], 2),
        (["--training.mixed_precision_param", "bfloat16", "--gradient_sync.accumulate_dtype", "bfloat16"], 2),
        (["--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"], 4),
        ([], 2),  # fp32 parameters: fp32 gradients
    ],
)
def test_training_counts_the_unsharded_gradients_the_planner_prices(overrides: list[str], world: int) -> None:
    args = ["--training.gradient_accumulation_steps", "2", "--gradient_sync.mode", "once_per_step", *overrides]
    cfg = load_config(None, [*BASE, *args])
    layout = layout_from_config(cfg, world)
    priced = peak._gathered(layout_args(layout), layout, rank_parts(layout_args(layout), layout, 0)).accumulated
    dtype = grad_accum.accumulation_dtype(cfg.training.mixed_precision_param, cfg.gradient_sync.accumulate_dtype)
    with parallelized(args, world=world) as parts:
        counted = grad_accum.gradient_bytes(parts[0], dtype)
    assert counted == pytest.approx(priced, rel=1e-9), (counted, priced, dtype)


def test_trainings_cuda_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA readings, stubbed (no GPU here): the step's peak (+ a fresh run's optimizer state), the total as the
    capacity, what is outside the allocator (total - free - reserved) as the reserve, max reserved / max allocated - 1
    as the slack."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 50 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 55 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 52 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (25 * GIB, 80 * GIB))
    need, budget = grad_accum.measured(torch.device("cuda"), 20 * GIB, 3 * GIB)
    assert need == Need(20 * GIB, 53 * GIB)
    assert budget == Budget(80 * GIB, 3 * GIB, pytest.approx(0.1))  # type: ignore[arg-type]
    assert not once_fits(need, budget)  # 73 x 1.1 + 3 = 83.3 GiB


def test_trainings_cpu_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU: this process's peak resident memory, the host's memory over the ranks on it, no reserve or slack."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    need, budget = grad_accum.measured(torch.device("cpu"), GIB, 0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert need.gradients == GIB and 0 < need.rest <= rss
    assert budget == Budget(grad_accum.host_memory() / 4)
