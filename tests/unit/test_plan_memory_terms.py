"""The planner's activation term, asserted directly: a pipeline rank keeps (stage-microbatches in flight) x (layers of
one of its stages) x (per-layer bytes of one microbatch). Under Interleaved1F1B with v = 2 stages per rank a rank's
layers split over its two stages, and each in-flight stage-microbatch holds one stage's layers, not the rank's."""

from __future__ import annotations

import math

from meshforge.model.flavors import get_flavor
from meshforge.plan.layout import Layout
from meshforge.plan.physics import schedules
from meshforge.plan.physics.memory import saved_bytes_per_token, transient_bytes_per_token
from meshforge.plan.physics.parts import rank_parts
from meshforge.plan.physics.peak import rank_allocated


def test_interleaved_activations_are_in_flight_times_layers_over_v() -> None:
    args, rank = get_flavor("tiny"), 0
    p, v, m, seq = 2, 2, 8, 256
    layout = Layout(
        flavor="tiny",
        seq_len=seq,
        local_batch_size=m,
        pp=p,
        schedule="Interleaved1F1B",
        stages_per_rank=v,
        first_stage_less_layers=0,
        last_stage_less_layers=0,
        ac_mode="none",
        param_dtype="float32",
    )
    parts = rank_parts(args, layout, rank)
    assert parts.layers == args.n_layers // p and parts.stage_layers == (2, 2) and not parts.head
    in_flight = schedules.in_flight(layout, rank)
    assert in_flight == (v - 1) * p + 2 * (p - 1 - rank) + 1  # the documented count for m a multiple of p
    per_layer = saved_bytes_per_token(args, layout) * seq  # one microbatch of one sequence
    activations = rank_allocated(args, layout, rank).activations
    saved = activations - transient_bytes_per_token(args, layout) * seq  # no head here: no loss term
    expected = in_flight * parts.layers / v * per_layer
    assert math.isclose(saved, expected, rel_tol=1e-9), (
        f"saved activations {saved:.4g} B != in-flight {in_flight} x layers {parts.layers} / v {v} x per-layer "
        f"{per_layer:.4g} B = {expected:.4g} B ({saved / expected:.2f}x: counted once per stage of the rank?)"
    )


def test_compiled_loss_is_read_per_torchtitan_commit() -> None:
    """TorchTitan compiles the loss with compile on from bbb1b61 (2025-04-02): the Trainy H200 and B200 rows are read
    so, the Dec-2024 compile rows (9dec370: commented out) are not; a compiled loss keeps 4 bytes per logit, not 12."""
    from dataclasses import replace

    from meshforge.plan.accuracy import loo
    from meshforge.plan.physics.memory import COMPILED_LOSS_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT

    read = {o.name: o.layout.compiled_loss for o in loo.observations()}
    assert read["trainy.8b_32"] and read["torchao-b200.8b_fp8"]
    assert not read["table1.fsdp_compile"] and not read["torchao.8b_bf16"]
    layout = next(o.layout for o in loo.observations() if o.name == "table1.fsdp_compile")
    args = get_flavor("8B")
    plain = rank_allocated(args, layout, 0).activations
    compiled = rank_allocated(args, replace(layout, compiled_loss=True), 0).activations
    logits = layout.local_batch_size * layout.seq_len * args.vocab_size
    assert math.isclose(plain - compiled, (LOSS_BYTES_PER_LOGIT - COMPILED_LOSS_BYTES_PER_LOGIT) * logits, rel_tol=1e-9)
