"""The planner's text report names every time and memory term the estimator can emit (issue 36: the memory levers'
terms ended `meshforge plan` in a KeyError while --json and --search worked). The estimator is run over every lever,
alone and together, with pipeline, tensor, context and expert parallelism, so a new term without a label fails here."""

from __future__ import annotations

import itertools

import pytest

from meshforge.cli import main
from meshforge.config.io import load_config
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import Estimate, estimate
from meshforge.plan.report import MEMORY_LABELS, TIME_LABELS, format_estimate

LEVERS = [
    ["--training.loss_chunks", "8"],
    ["--activation_checkpoint.offload"],
    ["--training.enable_cpu_offload"],
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--activation_checkpoint.mode", "none"]
TP2_CP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]
SHAPES = [
    (["--model.flavor", "8B"], 8),
    (["--model.flavor", "8B", *PP2], 8),
    (["--model.flavor", "8B", *TP2_CP2], 8),
    (["--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "2"], 4),
]


def estimates() -> list[Estimate]:
    """One estimate per shape and per subset of the levers (none, each, pairs, all) on an H100."""
    hw, out = load_hardware("h100"), []
    for (shape, world), n in itertools.product(SHAPES, range(len(LEVERS) + 1)):
        for levers in itertools.combinations(LEVERS, n):
            overrides = [*shape, "--training.seq_len", "4096", *[a for lever in levers for a in lever]]
            out.append(estimate(layout_from_config(load_config(None, overrides), world), hw))
    return out


def test_every_term_the_estimator_emits_has_a_label_and_is_rendered() -> None:
    hw = load_hardware("h100")
    seen_time: set[str] = set()
    seen_memory: set[str] = set()
    for est in estimates():
        seen_time |= set(est.time)
        seen_memory |= set(est.memory.as_dict())
        text = format_estimate(est, hw)  # raised KeyError on a lever's term
        for key in est.time:
            assert TIME_LABELS[key] in text, key
        for key in est.memory.as_dict():
            assert MEMORY_LABELS[key] in text, key
    assert seen_time - set(TIME_LABELS) == set() and seen_memory - set(MEMORY_LABELS) == set()
    # the sweep reaches the levers' terms, the bubble, EP and the host-held state (else it tests too little)
    wanted = {"chunked_loss_recompute", "activation_offload_copies", "cpu_offload_copies", "pipeline_bubble"}
    assert wanted | {"exposed_ep_comm"} <= seen_time, seen_time
    assert "host_offloaded" in seen_memory, seen_memory


@pytest.mark.parametrize("lever", LEVERS, ids=["loss_chunks", "activation_offload", "cpu_offload"])
def test_plan_with_each_lever_prints_the_report(lever: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model.flavor", "8B", "--world-size", "8", "--hardware", "h100", *lever]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per device" in out and "total" in out, out
