"""The state a live-recovering replica group receives (train/fault_tolerance.py FaultTolerance.state_dict and
load_state_dict), in one process without torchft: a fresh group loaded from a trained peer holds the peer's weights,
optimizer state, lr-scheduler position, data position and step. The end-to-end proof (a killed group rejoins, 1.5-3
min) is tests/integration/test_fault_tolerance.py; this fails in well under a second on the same bugs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from meshforge.config.io import load_config
from meshforge.data.loader import PackedDataLoader
from meshforge.train.fault_tolerance import FaultTolerance


def _group(steps: int) -> Any:
    """A TrainState's parts the recovery touches: a model, AdamW, a warm-up scheduler and the data loader."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    loader = PackedDataLoader(
        np.arange(200, dtype=np.int32), seq_len=4, local_batch_size=2, dp_rank=0, dp_degree=1, seed=3
    )
    state = SimpleNamespace(model_parts=[model], optimizer=optimizer, scheduler=scheduler, loader=loader, step=1)
    for _ in range(steps):
        inputs, _ = loader.next_batch()
        model(inputs[:, :4].float()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state.step += 1
    return state


def test_a_recovered_group_gets_weights_optimizer_lr_data_position_and_step() -> None:
    cfg = load_config(None, [])
    peer, fresh = _group(steps=5), _group(steps=0)
    sender, receiver = FaultTolerance(cfg, peer), FaultTolerance(cfg, fresh)
    receiver.load_state_dict(sender.state_dict())
    assert receiver.recovered == 5, f"recovered step {receiver.recovered}, the peer finished 5"
    for mine, theirs in zip(fresh.model_parts[0].parameters(), peer.model_parts[0].parameters(), strict=True):
        assert torch.equal(mine, theirs), "the weights were not received"
        got, want = fresh.optimizer.state[mine], peer.optimizer.state[theirs]
        assert set(got) == set(want) and all(
            torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])) for k in want
        )
    assert fresh.scheduler.last_epoch == peer.scheduler.last_epoch == 5, "the lr-scheduler position was not received"
    assert fresh.scheduler.get_last_lr() == peer.scheduler.get_last_lr()
    assert fresh.loader.state_dict() == peer.loader.state_dict(), "the data position was not received (samples twice)"
    mine_next, theirs_next = fresh.loader.next_batch(), peer.loader.next_batch()
    assert torch.equal(mine_next[0], theirs_next[0]), "the recovered group reads other samples than its peer"
