"""Recovery paths with the real objects (issue 37, "a path tested with a stub where the real object matters"): a
retried fault-tolerant step trains on the same batch again, read from the real PackedDataLoader (a two-source
mixture: its per-source counts are part of the position), and a recovering group lands on the sender's next batch.
Only torchft's Manager is a stand-in (its quorum and commit vote need a Lighthouse)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from meshforge.config.io import load_config
from meshforge.data.loader import ArrayStream, PackedDataLoader
from meshforge.train import fault_tolerance as ft


def real_loader() -> PackedDataLoader:
    """Two sources mixed 3:1, shuffled: each batch's samples differ from the next's."""
    sources = [ArrayStream(np.arange(4000, dtype=np.int64)), ArrayStream(np.arange(10_000, 13_000, dtype=np.int64))]
    return PackedDataLoader(sources, seq_len=16, local_batch_size=3, dp_rank=1, dp_degree=2, seed=7, weights=[3.0, 1.0])


def wrapper(votes: list[bool], logs: Path) -> tuple[ft.FaultTolerance, SimpleNamespace, torch.nn.Linear]:
    """The fault-tolerance wrapper around a real loader, model, AdamW and scheduler; the commit votes in order."""
    cfg = load_config(None, ["--fault_tolerance.enable", "--fault_tolerance.start_together", "false"])
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    state = SimpleNamespace(model_parts=[model], loader=real_loader(), optimizer=optimizer, scheduler=scheduler)
    state.metrics, state.step = SimpleNamespace(console=0), 3
    manager = SimpleNamespace(start_quorum=lambda: None, should_commit=lambda: votes.pop(0), _min_replica_size=1)
    manager.num_participants = lambda: 2
    guard = ft.FaultTolerance(cfg, state, manager=manager)  # type: ignore[arg-type]
    guard.log, guard.attempts = logs / "ft_steps.jsonl", logs / "ft_attempts.jsonl"
    return guard, state, model


def test_a_retried_step_reads_the_same_batch_from_the_real_loader_then_moves_on(tmp_path: Path) -> None:
    guard, state, model = wrapper([False, False, True], tmp_path)
    loader = state.loader
    loader.next_batch()  # an earlier step: the retried one does not start at position 0
    reference = real_loader()
    reference.next_batch()
    want_first, want_next = reference.next_batch(), reference.next_batch()
    for attempt in range(3):
        guard.start_step()
        inputs, labels = loader.next_batch()
        model(inputs[:, :4].float()).sum().backward()
        assert torch.equal(inputs, want_first[0]) and torch.equal(labels, want_first[1]), f"attempt {attempt}"
        committed = guard.should_commit()
        assert committed == (attempt == 2) and guard.retry == (attempt < 2)
        if not committed:
            assert all(p.grad is None for p in model.parameters()), "a retried step kept the failed step's gradients"
    guard.start_step()
    inputs, _ = loader.next_batch()
    assert guard.attempts is not None
    assert [json.loads(row)["committed"] for row in guard.attempts.read_text().splitlines()] == [False, False, True]
    assert torch.equal(inputs, want_next[0]), "after the commit the loader did not move on to the next batch"


def test_a_recovering_group_continues_from_the_senders_real_loader_position(tmp_path: Path) -> None:
    sender, sender_state, _ = wrapper([True], tmp_path)
    for _ in range(3):
        sender_state.loader.next_batch()
    saved = sender.state_dict()
    receiver, receiver_state, _ = wrapper([], tmp_path)
    receiver.load_state_dict(saved)
    assert torch.equal(receiver_state.loader.next_batch()[0], sender_state.loader.next_batch()[0])
    assert receiver.recovered == sender_state.step - 1
