"""Pipeline stages free what their schedule no longer needs (parallel/pipeline/free_outputs.py): the bytes a
stage's outputs and receive buffers hold between compute actions, on a real 2-stage gloo run, and its losses."""

from __future__ import annotations

from typing import Any

import pytest
from launcher import run_ranks
from parity import GLOBAL_BATCH, Trace, train_records

pytestmark = pytest.mark.distributed


def held_bytes(overrides: list[str]) -> dict[str, Any]:
    """Runs inside a rank: train, recording before every compute action the largest bytes held by a stage's sent forward
    outputs (``fwd_cache``) and by its receive buffers, and one stage boundary's bytes."""
    from meshforge.parallel.pipeline.free_outputs import LeanPipelineStage, local_of

    peak = {"outputs": 0, "buffers": 0, "boundary": 0}

    def nbytes(t: Any) -> int:
        return local_of(t).untyped_storage().nbytes() if t is not None else 0

    def record(stage: LeanPipelineStage) -> None:
        local = stage.stage_index_to_group_rank.get(stage.stage_index + 1) == stage.group_rank  # V: no send
        sent = not stage.is_last and not local
        outs = [o for outputs, _ in stage.fwd_cache.values() for o in outputs] if sent else []
        infos = [*stage.args_recv_info.values(), *getattr(stage, "grad_recv_info", {}).values()]
        buffers = [getattr(info, "buffer", None) for group in infos for info in group]
        peak["outputs"] = max(peak["outputs"], sum(map(nbytes, outs)))
        peak["buffers"] = max(peak["buffers"], sum(map(nbytes, buffers)))
        meta = stage._stage_meta.inputs[0] if not stage.is_first else stage._stage_meta.outputs[0]
        peak["boundary"] = max(peak["boundary"], meta.shape.numel() * meta.dtype.itemsize)

    def wrap(name: str) -> None:
        original = getattr(LeanPipelineStage, name)

        def timed(self: LeanPipelineStage, *args: Any, **kwargs: Any) -> Any:
            record(self)
            return original(self, *args, **kwargs)

        setattr(LeanPipelineStage, name, timed)

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        wrap(name)
    records = train_records(overrides)
    return {"peak": peak, "losses": Trace(records)}


@pytest.mark.parametrize(("schedule", "buffers"), [("1F1B", 2), ("Interleaved1F1B", 8), ("ZBVZeroBubble", 6)])
def test_stages_hold_no_sent_output_and_receive_buffers_only_in_flight(schedule: str, buffers: int) -> None:
    """pp 2, 8 microbatches of 1: a non-last stage's sent outputs keep no storage (one-element placeholders), and the
    receive buffers in use stay within the microbatches in flight (torch alone keeps one activation and one gradient
    buffer per microbatch and stage: 8 stage boundaries on each 1F1B stage, 16 on an interleaved middle stage; under
    ZBV it also keeps the same-rank stages' aliases: 11)."""
    args = ["--parallelism.pipeline_parallel_microbatch_size", "1", "--parallelism.pipeline_parallel_degree", "2"]
    args += ["--parallelism.pipeline_parallel_schedule", schedule, "--training.local_batch_size", str(GLOBAL_BATCH)]
    ranks = run_ranks(held_bytes, 2, [*args, "--training.steps", "2"])
    for rank, result in enumerate(ranks):
        peak = result["peak"]
        assert peak["boundary"] > 0, "no compute action was recorded"
        assert peak["outputs"] <= 4 * GLOBAL_BATCH, (rank, peak)  # at most a 4-byte placeholder per microbatch
        assert peak["buffers"] <= buffers * peak["boundary"], (rank, peak, peak["buffers"] / peak["boundary"])
    assert list(ranks[0]["losses"]) == list(ranks[1]["losses"])
