"""Zero-bubble schedules and activation checkpointing: the split input/weight backward those schedules run (torch's
own stage_backward_input / stage_backward_weight) gives the same gradients under full and every-N-th-block AC as
without AC, and fails under per-op selective AC; that combination (the default AC) is refused before any step, in
training and in the dry run."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshforge.config.io import load_config
from meshforge.config.schema import ActivationCheckpoint
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model
from meshforge.parallel.activation_ckpt import apply_ac
from meshforge.parallel.pipeline.rules import check_csv_split_backward
from meshforge.parallel.pipeline.schedule import ScheduleSpec, schedule_spec
from meshforge.tools.dry_run import dry_run

ZERO_BUBBLE = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def split_backward_grads(ac: ActivationCheckpoint) -> list[torch.Tensor]:
    """Two blocks of the tiny model as one stage: input gradients, then weight gradients (as a zero-bubble
    schedule's I and W actions); returns the input gradient and every weight gradient."""
    model = build_model(get_flavor("tiny").with_seq_len(16))
    model.to_empty(device="cpu")
    model.init_weights(0)
    apply_ac(model, ac)
    blocks = list(model.layers.values())[:2]
    h = torch.randn(2, 16, model.args.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = h
    for block in blocks:
        out = block(out, model.rope[:16])
    loss = out.float().pow(2).mean()
    params = [p for block in blocks for p in block.parameters()]
    grads_in, groups = stage_backward_input([loss], None, [h], iter(params))
    stage_backward_weight(iter(params), groups)
    assert grads_in[0] is not None
    return [grads_in[0], *[p.grad for p in params if p.grad is not None]]


def test_split_backward_is_exact_under_full_and_per_block_ac_and_fails_under_per_op_ac() -> None:
    want = split_backward_grads(ActivationCheckpoint(mode="none"))
    assert len(want) == 1 + 18  # the input and 9 weights per block
    for ac in (ActivationCheckpoint(mode="full"), ActivationCheckpoint(mode="selective", selective_ac_option="2")):
        got = split_backward_grads(ac)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(RuntimeError, match="backward an extra time"):
        split_backward_grads(ActivationCheckpoint(mode="selective", selective_ac_option="op"))


def check_activation_checkpoint(spec: ScheduleSpec, ac: ActivationCheckpoint) -> None:
    """The split-backward AC rule (parallel/pipeline/rules.py; the composability table's for named schedules)."""
    kw = {"ac_mode": ac.mode, "ac_option": ac.selective_ac_option}
    check_csv_split_backward(spec.name, spec.split_backward, compile_enabled=False, **kw)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_zero_bubble_with_per_op_ac_is_refused_in_one_line(name: str) -> None:
    spec = schedule_spec(name, "", 2)
    with pytest.raises(ValueError, match=f"'op' \\(the default\\) does not work with the {name} schedule") as info:
        check_activation_checkpoint(spec, ActivationCheckpoint())
    assert "\n" not in str(info.value) and "activation_checkpoint.mode = 'full'" in str(info.value)
    for ok in ("none", "full"):
        check_activation_checkpoint(spec, ActivationCheckpoint(mode=ok))  # type: ignore[arg-type]
    check_activation_checkpoint(spec, ActivationCheckpoint(selective_ac_option="1"))
    check_activation_checkpoint(schedule_spec("1F1B", "", 2), ActivationCheckpoint())  # no split backward


def test_dry_run_refuses_zero_bubble_with_the_default_ac(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model.flavor", "tiny", "--parallelism.pipeline_parallel_degree", "2", "--training.device", "cpu"]
    args += ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--training.local_batch_size", "4"]
    assert dry_run(load_config(None, args), 2) == 2
    err = capsys.readouterr().err  # the composability table's refusal, with the working settings
    assert err.count("\n") == 1 and "ZBVZeroBubble with AC per-op selective" in err and "mode = 'full'" in err, err
    assert dry_run(load_config(None, [*args, "--activation_checkpoint.mode", "full"]), 2) == 0
