"""Planner terms at TP, CP, PP and EP > 1 and in both dtypes, against hand computations (issue 37: "planner terms
tested at one degree", "terms whose error a golden refit absorbs"). Each figure below is written out from the
model's shapes (8B: dim 4096, vocab 128256, 32 layers; debugmoe: 8 experts of 256 x 256), not from the shipped
constants and not from the function under test, so a term off by a degree or a dtype fails here whatever a refit of
plan/shipped.py would absorb."""

from __future__ import annotations

import dataclasses

import pytest

from meshforge.model.flavors import get_flavor
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout
from meshforge.plan.physics import levers, peak
from meshforge.plan.physics.estimate import Rates
from meshforge.plan.physics.parts import RankParts, moe_block_full_numel, routed_numel

DIM, VOCAB = 4096, 128256
RATES = Rates(matmul=4e14, head_matmul=5e14, attention=3e14, memory=2e12, nominal_peak=9e14)


def layout(**kw: object) -> Layout:
    """8B, seq 8192, local batch 4 of microbatches of 1 (pipeline: 4 microbatches per step)."""
    base: dict[str, object] = dict(flavor="8B", seq_len=8192, local_batch_size=4, microbatch_size=1)
    return Layout(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("tp", "cp", "pp"), [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 2)])
def test_chunked_loss_recompute_at_every_tp_cp_pp(tp: int, cp: int, pp: int) -> None:
    """One more forward of the output projection per token: 2 x dim x vocab / tp FLOPs per local token (seq / cp)."""
    lay = layout(tp=tp, cp=cp, pp=pp, dp_shard=2, loss_chunks=8)
    m, sequences = (4, 1) if pp > 1 else (1, 4)  # a pipeline step: 4 microbatches of 1 sequence; else 1 of 4
    assert (lay.num_microbatches, lay.microbatch_sequences) == (m, sequences)
    parts = RankParts(layers=16, embedding=False, head=True, stage_layers=(16,))
    got = levers.lever_times(get_flavor("8B"), lay, load_hardware("h100"), RATES, parts, 10**9, 1.0)
    flops = m * 2 * (sequences * 8192 / cp) * DIM * VOCAB / tp
    assert got["chunked_loss_recompute"] == pytest.approx(flops / 5e14, rel=1e-12)
    body = RankParts(layers=16, embedding=True, head=False, stage_layers=(16,))  # a rank without the head pays none
    assert "chunked_loss_recompute" not in levers.lever_times(
        get_flavor("8B"), lay, load_hardware("h100"), RATES, body, 10**9, 1.0
    )


@pytest.mark.parametrize("reshard", [True, False])
def test_cpu_offload_copies_at_a_pipeline_degree(reshard: bool) -> None:
    """Each all-gather copies the fp32 shard host-to-device (twice per microbatch when FSDP reshards after forward),
    each reduce-scatter the fp32 gradient back: (gathers + m) x numel x 4 bytes over PCIe Gen5 (50 GB/s)."""
    lay = layout(pp=2, dp_shard=4, cpu_offload=True, reshard_after_forward=reshard)
    parts = RankParts(layers=16, embedding=True, head=False, stage_layers=(16,))
    got = levers.lever_times(get_flavor("8B"), lay, load_hardware("h100"), RATES, parts, 10**9, 0.0)
    gathers = 4 * (2 if reshard else 1)
    assert got["cpu_offload_copies"] == pytest.approx((gathers + 4) * 10**9 * 4 / 50e9, rel=1e-3)
    # the host AdamW step: 48 bytes per parameter (memory.OPTIMIZER_TRAFFIC_PER_PARAM) at 20 GB/s
    assert got["optimizer"] == pytest.approx(10**9 * 48 / 20e9)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize(("dtype", "e"), [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_loss_bytes_in_each_dtype_at_each_tp(dtype: str, e: int, tp: int, lean: bool) -> None:
    """The head's saved inputs (the norm's, sequence-sharded / tp: its input in the lean step, e, or eager autograd's
    e + 8; the projection's: e, whole) and the loss's logits: 12 fp32 bytes each (16 under loss parallel), vocab / tp
    of them, one chunk's."""
    lay = dataclasses.replace(layout(tp=tp, dp_shard=2, param_dtype=dtype, loss_chunks=4), lean_saves=lean)
    tokens = 4 * 8192
    per_logit = 16 if tp > 1 else 12
    norm = e if lean else e + 8
    want = tokens * DIM * (norm / tp + e) + per_logit * tokens * VOCAB / tp / 4
    assert peak.loss_bytes(get_flavor("8B"), lay, tokens) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("reduce_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("accumulate_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("param_dtype", "e"), [("bfloat16", 2), ("float32", 4)])
def test_pipeline_buffers_in_each_dtype_at_tp_and_pp(
    reduce_dtype: str, accumulate_dtype: str, param_dtype: str, e: int
) -> None:
    """A pipeline rank under FSDP x TP: its pipeline buffers (microbatch x seq x dim activations in the param dtype,
    / tp: meshforge's stages keep the gradient being received, free_outputs.py; TorchTitan's a send and a receive
    buffer per stage) and the microbatches' accumulated unsharded gradients in gradient_sync.accumulate_dtype
    whatever the reduce dtype (fp32 parameters: fp32; parallel/fsdp.py accumulate_in)."""
    args = get_flavor("8B")
    lay = layout(tp=2, pp=2, dp_shard=2, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    lay = dataclasses.replace(lay, accumulate_dtype=accumulate_dtype)
    r = 2 if accumulate_dtype == "bfloat16" and param_dtype == "bfloat16" else 4
    parts = RankParts(layers=16, embedding=False, head=False, stage_layers=(16,))
    g = peak._gathered(args, lay, parts)
    assert g.p2p == 1 * 8192 * DIM * e / 2
    assert peak._gathered(args, dataclasses.replace(lay, impl="torchtitan"), parts).p2p == 2 * 1 * 8192 * DIM * e / 2
    hidden = 14336
    block = 2 * DIM + (DIM * DIM + 2 * DIM * 1024 + DIM * DIM) / 2 + 3 * DIM * hidden / 2  # norms; q k v o; w1 w2 w3
    assert g.accumulated == 16 * block * r


def test_expert_parallel_splits_the_experts_then_fsdp_their_rows() -> None:
    """debugmoe: 8 routed experts, w1 / w3 (8, 256, 256), w2 (8, 256, 256). EP 2 over 4 FSDP ranks: 4 experts per
    rank, each chunked over the 2 remaining ranks; gathered (FSDP's all-gather): the 4 experts whole."""
    args = get_flavor("debugmoe")
    assert routed_numel(args, 4, 2) == 4 * 3 * 128 * 256
    assert routed_numel(args, 4, 1) == 2 * 3 * 256 * 256
    assert routed_numel(args, 8, 4) == 2 * 3 * 128 * 256
    full_ep2, full_ep1 = moe_block_full_numel(args, 1, 2), moe_block_full_numel(args, 1, 1)
    assert full_ep1 - full_ep2 == 4 * 3 * 256 * 256  # EP 2 gathers half the experts


@pytest.mark.parametrize(
    ("reshard", "sync", "regather"),
    [(True, "every_microstep", "reshard"), (False, "every_microstep", "reshard"), (True, "once_per_step", "reshard"),
     (True, "once_per_step", "keep"), (False, "once_per_step", "reshard")],
)  # fmt: skip
def test_fsdp_exchange_sums_each_collective_as_often_as_it_runs(reshard: bool, sync: str, regather: str) -> None:
    """FSDP 4 x TP 2, 4 micro-steps, no compute to hide behind (comm_overlaps_compute off): the exchange per step is
    the sum of the collectives that run, written out per schedule from one block's all-gather (ag) and reduce-scatter
    (rs) and the root's (the sample tool found every `+ rs` / `- rs` of estimate.py surviving the fast tests)."""
    import dataclasses

    from meshforge.plan.physics import comm
    from meshforge.plan.physics.estimate import fsdp_exposed, rank_time, rates, root_full_numel
    from meshforge.plan.physics.parts import gathered_layer_bytes, part_numel

    h100 = load_hardware("h100")
    hw = dataclasses.replace(h100, spec=dataclasses.replace(h100.spec, comm_overlaps_compute=False))
    lay = layout(dp_shard=4, tp=2, local_batch_size=1, grad_accum=4, reshard_after_forward=reshard)
    lay = dataclasses.replace(lay, gradient_sync=sync, regather=regather)
    args, n, blocks = get_flavor("8B"), 4, 32
    assert lay.num_microbatches == n
    rt = rank_time(args, lay, hw, rates(lay, hw), 0)
    link = comm.axis_link(lay, ("dp_shard", "cp"), hw)
    ag = comm.all_gather(gathered_layer_bytes(args, lay), 4, link)
    rs = comm.reduce_scatter(part_numel(args, "block", 2, 1) * 4, 4, link)  # fp32 gradients
    root_numel = root_full_numel(args, lay, rt.parts)
    root_ag = comm.all_gather(root_numel * 2, 4, link)
    root = root_ag + comm.reduce_scatter(root_numel * 4, 4, link)
    if sync == "every_microstep":  # each micro-step gathers every block (twice when resharded) and reduces it
        want = (
            n * (2 * blocks * ag + (blocks + 1) * rs + root)
            if reshard
            else blocks * ag + n * ((blocks + 1) * rs + root)
        )
    elif not reshard:  # once per step, kept gathered: gathered once, the root again each micro-step, reduced once
        want = blocks * ag + (n - 1) * root_ag + (blocks + 1) * rs + root
    else:  # once per step: n - 1 micro-steps gather (forward unless kept, backward) and the last one also reduces
        again = 0.0 if regather == "keep" else blocks * ag
        want = blocks * ag + (n - 1) * (again + blocks * ag + root_ag) + blocks * ag + (blocks + 1) * rs + root
    assert fsdp_exposed(args, lay, hw, rt) == pytest.approx(want, rel=1e-4)
