"""training.enable_cpu_offload (FSDP2 CPUOffloadPolicy): the policy on every fully_shard, parity with one process
(losses and grad norms, with clipping and with gradient accumulation), and checkpoints that resume across offload
on / off in both directions."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import BASE, GLOBAL_BATCH, assert_parity, losses, reference

pytestmark = pytest.mark.distributed

OFFLOAD = ["--training.enable_cpu_offload"]


def offload_policies(overrides: list[str]) -> tuple[int, list[tuple[str, bool]]]:
    """Runs inside a rank: set up, then the block count and each FSDP module's (policy class, pin_memory)."""
    from torch.distributed.fsdp import FSDPModule

    from meshforge.config.io import load_config
    from meshforge.train.loop import setup

    state = setup(load_config(None, [*BASE, "--job.dump_folder", tempfile.mkdtemp(), *overrides]))
    out = []
    for module in state.model_parts[0].modules():
        if isinstance(module, FSDPModule):
            policy = module._get_fsdp_state()._fsdp_param_group.offload_policy  # type: ignore[union-attr]
            out.append((type(policy).__name__, bool(getattr(policy, "pin_memory", False))))
    return state.model_args.n_layers, out


def test_every_fully_shard_gets_the_cpu_offload_policy() -> None:
    blocks, got = run_ranks(offload_policies, 2, ["--training.local_batch_size", "4", *OFFLOAD])[0]
    assert got == [("CPUOffloadPolicy", False)] * (blocks + 1), got  # each block + the root; pinned on CUDA only
    blocks, plain = run_ranks(offload_policies, 2, ["--training.local_batch_size", "4"])[0]
    assert plain == [("OffloadPolicy", False)] * (blocks + 1), plain


def test_fsdp2_cpu_offload_matches_single_process() -> None:
    got = losses(2, ["--training.local_batch_size", str(GLOBAL_BATCH // 2), *OFFLOAD])
    assert_parity(got, reference())


def test_fsdp2_cpu_offload_with_gradient_accumulation_matches_single_process() -> None:
    args = ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2", *OFFLOAD]
    assert_parity(losses(2, args), reference())


def train_losses(dump: str, overrides: list[str], stop_at: int = 0) -> dict[int, float]:
    """Runs inside a rank: train (resuming from ``dump`` when it holds a checkpoint), stop after ``stop_at``."""
    from meshforge.config.io import load_config
    from meshforge.train.loop import run_steps, setup

    state = setup(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))
    out: dict[int, float] = {}
    for record in run_steps(state):
        out[record["step"]] = record["loss"]
        if record["step"] == stop_at:
            break
    if state.checkpointer is not None:
        state.checkpointer.close()
    return out


@pytest.mark.parametrize(("first", "second"), [(OFFLOAD, []), ([], OFFLOAD)], ids=["on-then-off", "off-then-on"])
def test_checkpoint_resumes_across_cpu_offload(first: list[str], second: list[str]) -> None:
    args: list[Any] = ["--training.steps", "8", "--training.local_batch_size", "4"]
    whole = run_ranks(train_losses, 2, tempfile.mkdtemp(), args)[0]
    ckpt = [*args, "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.last_save_model_only", "false"]
    dump = tempfile.mkdtemp()
    before = run_ranks(train_losses, 2, dump, [*ckpt, *first], 4)[0]
    assert (Path(dump) / "checkpoint/step-4/meshforge.json").is_file()
    after = run_ranks(train_losses, 2, dump, [*ckpt, *second])[0]
    assert sorted(before) == [1, 2, 3, 4] and sorted(after) == [5, 6, 7, 8]
    for step, loss in {**before, **after}.items():
        assert abs(loss - whole[step]) <= 1e-6 * abs(whole[step]), (step, loss, whole[step])


def offload_branch_records(overrides: list[str]) -> tuple[list[bool], list[dict[str, Any]]]:
    """Runs inside a rank: train; each FSDP parameter's ``offload_to_cpu`` (FSDP's offload branch: no foreach
    all-gather copy under a param dtype, gradients accumulated on the host) and the records."""
    import tempfile as tf

    from torch.distributed.fsdp import FSDPModule

    from meshforge.config.io import load_config
    from meshforge.train.loop import run_steps, setup

    state = setup(load_config(None, [*BASE, "--job.dump_folder", tf.mkdtemp(), *overrides]))
    flags = [
        p.offload_to_cpu
        for m in state.model_parts[0].modules()
        if isinstance(m, FSDPModule)
        for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params  # type: ignore[union-attr]
    ]
    return flags, list(run_steps(state))


def test_cpu_offload_branch_is_taken_and_changes_no_bit() -> None:
    """On a CPU nothing moves, but FSDP's offload branch is different code (bf16 params: no foreach copy into the
    all-gather; gradient accumulation: the host-side add): on vs off must agree bitwise, with the branch on."""
    args = ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2"]
    args += ["--training.mixed_precision_param", "bfloat16", "--training.steps", "3"]
    on_flags, on = run_ranks(offload_branch_records, 2, [*args, *OFFLOAD])[0]
    off_flags, off = run_ranks(offload_branch_records, 2, args)[0]
    assert on_flags and all(on_flags) and not any(off_flags)
    assert [(r["loss"], r["grad_norm"]) for r in on] == [(r["loss"], r["grad_norm"]) for r in off]
