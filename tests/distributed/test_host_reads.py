"""Zero device-to-host reads in a training step that does not log, on every layout: the real ``train_step`` (and the
rest of the loop's iteration) under meshforge's host-read counter (device/host_reads.py), steps 2 and 4 of 5 with
metrics.log_freq 3. A failure names each read's op and its meshforge line.

What a CPU run cannot see: a copy between the device and pinned host memory is a host-to-host copy here (activation
offload's save_on_cpu, CPU offload's FSDP2 copies), so those layouts prove the rest of their step; the counter sees
such a copy on CUDA (``copy_`` / ``_to_copy`` from an accelerator into a host tensor)."""

from __future__ import annotations

from typing import Any

import pytest
from host_read_run import count_host_reads
from launcher import run_ranks

pytestmark = pytest.mark.distributed

LB = ["--training.local_batch_size", "2"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one process": (1, LB),
    "fsdp 2": (2, LB),
    "fsdp 2 gradient accumulation 2": (2, [*LB, "--training.gradient_accumulation_steps", "2"]),
    "hsdp 2x2": (
        4,
        [
            *("--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "2"),
            *("--parallelism.data_parallel_shard_degree", "2"),
        ],
    ),
    "tp 2": (2, [*LB, "--parallelism.tensor_parallel_degree", "2"]),
    "pp 2 1F1B": (
        2,
        [
            *(*LB, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"),
            *("--parallelism.pipeline_parallel_microbatch_size", "1"),
        ],
    ),
    "cp 2": (2, [*LB, "--parallelism.context_parallel_degree", "2"]),
    "activation offload": (1, [*LB, "--activation_checkpoint.offload"]),
    "cpu offload fsdp 2": (2, [*LB, "--training.enable_cpu_offload"]),
    "moe ep 2": (2, [*LB, "--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "2"]),
}
# Reads a layout cannot avoid today, by call site: expert parallel's token all-to-all takes its split sizes as host
# lists (torch's all_to_all_single, as TorchTitan's EP does), two reads per MoE layer per micro-step. Anything else
# fails the test.
KNOWN = {
    "moe ep 2": (
        "Tensor.tolist() at meshforge/parallel/expert_parallel.py:52 __call__",
        "Tensor.tolist() at meshforge/parallel/expert_parallel.py:53 __call__",
    )
}


def unexpected(layout: str, reads: dict[int, list[str]]) -> dict[int, list[str]]:
    known = KNOWN.get(layout, ())
    return {step: [r for r in rs if r not in known] for step, rs in reads.items() if any(r not in known for r in rs)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_that_does_not_log_reads_nothing_from_the_device(layout: str) -> None:
    world, args = LAYOUTS[layout]
    results = run_ranks(count_host_reads, world, args)
    for rank, out in enumerate(results):
        assert sorted(out["reads"]) == [2, 4], out["reads"].keys()  # the non-log steps were counted
        assert len(out["records"]) == 3 if rank == 0 else True  # steps 1, 3, 5 logged
        bad = unexpected(layout, out["reads"])
        assert not bad, f"{layout}, rank {rank}: host reads in a step that does not log:\n" + "\n".join(
            f"  step {step}: {read}" for step, reads in bad.items() for read in reads
        )


def test_the_counter_sees_a_host_read_planted_in_the_step_and_names_its_line() -> None:
    """The counter itself: a ``float(loss)`` added to train_step's loss (by wrapping forward_backward) is found,
    with the meshforge line that made it."""
    import inspect

    from meshforge.train import loop

    lines, first = inspect.getsourcelines(loop.train_step)
    line = first + next(i for i, text in enumerate(lines) if "forward_backward(state" in text)
    out = run_ranks(_planted, 1, LB)[0]
    want = f"_local_scalar_dense at meshforge/train/loop.py:{line} train_step (inside "
    assert len(out) == 2 and all(r.startswith(want) and "test_host_reads.py" in r for r in out), (want, out)


def _planted(args: list[str]) -> list[str]:
    from meshforge.train import loop

    real = loop.forward_backward

    def reading(*a: object, **k: object) -> object:
        loss = real(*a, **k)  # type: ignore[arg-type]
        loop.global_mean(loss, None).item()  # a host read inside the step, through a meshforge function
        return loss

    loop.forward_backward = reading  # type: ignore[assignment]
    try:
        out = count_host_reads(args)
    finally:
        loop.forward_backward = real  # type: ignore[assignment]
    return [r for reads in out["reads"].values() for r in reads]


def _fault_tolerant(args: list[str]) -> dict[str, Any]:
    """Runs inside a rank: one torchft replica group (its own Lighthouse), so the step runs the quorum, the
    cross-group gradient all-reduce, the commit vote and the committed step's record."""
    from meshforge.train.ft_cli import start_lighthouse

    server = start_lighthouse(0, 1, 1000, 1000)
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "1", "--fault_tolerance.params_digest"]
    ft += ["--fault_tolerance.lighthouse"]  # the digest on: its host copy must stay on the log steps
    try:
        return count_host_reads([*args, *ft, server.address()])
    finally:
        server.shutdown()


def test_a_fault_tolerant_step_that_does_not_log_reads_nothing_from_the_device() -> None:
    """torchft's own commit vote synchronises the device stream (torchft/manager.py should_commit): not a tensor
    read, and not meshforge's to remove; the integrity digest's host copy runs on log steps only."""
    pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")
    for rank, out in enumerate(run_ranks(_fault_tolerant, 2, LB)):
        assert sorted(out["reads"]) == [2, 4] and not any(out["reads"].values()), (rank, out["reads"])
