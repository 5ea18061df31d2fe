"""Fault tolerance's bad-input paths (train/fault_tolerance.py), without processes: torchft missing, an unreachable
Lighthouse, a reused replica id or groups of different sizes, ids out of range; and the data split over groups."""

from __future__ import annotations

import socket
import sys
import time
from types import SimpleNamespace

import pytest

from meshforge.config.io import load_config
from meshforge.errors import ConfigError
from meshforge.train import fault_tolerance as ft


def test_missing_torchft_is_one_line_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError, match=r"pip install 'meshforge\[ft\]'"):
        ft.import_torchft()


def test_an_unreachable_lighthouse_is_named_within_the_init_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"127.0.0.1:{port} within 1 s \(comm.init_timeout_seconds\)"):
        ft.check_lighthouse(f"http://127.0.0.1:{port}", 1.0)
    assert time.monotonic() - start < 5


def test_a_reused_replica_id_is_refused_before_the_first_step() -> None:
    ids = ["meshforge_w2_r0:aaa", "meshforge_w2_r0:bbb"]
    with pytest.raises(ConfigError, match="replica_id = 0 is already used"):
        ft.check_quorum(ids, "meshforge_w2_r0", step=1)
    ft.check_quorum(ids, "meshforge_w2_r0", step=5)  # a running group is not stopped by a newcomer's mistake
    ft.check_quorum(["meshforge_w2_r0:a", "meshforge_w2_r1:b"], "meshforge_w2_r1", step=1)


def test_groups_of_different_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"different sizes \(2 vs 4 ranks\)"):
        ft.check_quorum(["meshforge_w2_r0:a", "meshforge_w4_r1:b"], "meshforge_w4_r1", step=1)


def test_groups_of_the_same_size_but_another_layout_are_refused() -> None:
    pp2 = ft.replica_name(load_config(None, ["--parallelism.pipeline_parallel_degree", "2"]), 2)
    fsdp2 = ft.replica_name(load_config(None, ["--fault_tolerance.replica_id", "0"]), 2)
    assert pp2 == "meshforge_w2-pp2-tp1-cp1-ep1_r0" and fsdp2 == "meshforge_w2_r0"  # plain FSDP keeps the short id
    with pytest.raises(ConfigError, match=r"different layouts \(w2 vs w2-pp2-tp1-cp1-ep1\)"):
        ft.check_quorum([fsdp2 + ":a", pp2.replace("_r0", "_r1") + ":b"], pp2.replace("_r0", "_r1"), step=1)
    ft.check_quorum([pp2 + ":a", pp2.replace("_r0", "_r1") + ":b"], pp2, step=1)  # the same layout: accepted


def test_the_managers_quorum_is_checked_as_it_arrives() -> None:
    fake = SimpleNamespace(_quorum=lambda **kw: SimpleNamespace(replica_ids=["meshforge_w2_r1:x", "meshforge_w2_r1:y"]))
    client = ft._CheckedClient(fake, "meshforge_w2_r1", lambda: 1)
    with pytest.raises(ConfigError):
        client._quorum(group_rank=0)


def test_replica_id_out_of_range_and_the_data_slots() -> None:
    with pytest.raises(ConfigError, match=r"replica_id = 2 must be in \[0, fault_tolerance.group_size = 2\)"):
        load_config(
            None, ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2"]
        )
    cfg = load_config(
        None, ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1"]
    )
    assert ft.data_shard(cfg, dp_rank=1, dp=2) == (3, 4)  # group 1's dp rank 1 reads slot 3 of 4
    assert ft.data_shard(load_config(None, []), dp_rank=1, dp=2) == (1, 2)


def test_a_retried_step_restores_the_expert_biases_and_recovery_carries_them() -> None:
    import torch

    from meshforge.model.flavors import get_flavor
    from meshforge.model.moe import MoE

    cfg = load_config(None, ["--fault_tolerance.enable", "--fault_tolerance.start_together", "false"])
    moe = MoE(get_flavor("debugmoe"), None)
    assert moe.expert_bias is not None
    moe.expert_bias += 0.5
    loader = SimpleNamespace(state_dict=lambda: {"pos": 3}, load_state_dict=lambda s: None)
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None, state={})
    scheduler = SimpleNamespace(last_epoch=4, state_dict=dict, load_state_dict=lambda s: None, step=lambda: None)
    state = SimpleNamespace(model_parts=[moe], loader=loader, optimizer=optimizer, metrics=SimpleNamespace(console=0))
    state.scheduler, state.step = scheduler, 5
    manager = SimpleNamespace(start_quorum=lambda: None, should_commit=lambda: False, _min_replica_size=1)
    wrapper = ft.FaultTolerance(cfg, state, manager=manager)  # type: ignore[arg-type]
    wrapper.start_step()
    moe.expert_bias += 1.0  # the step's bias update (train/moe_balance.py), then the commit is refused
    assert not wrapper.should_commit() and wrapper.retry
    assert torch.equal(moe.expert_bias, torch.full_like(moe.expert_bias, 0.5))  # as before the failed step
    saved = wrapper.state_dict()  # what a live peer sends a recovering group
    moe.expert_bias.zero_()
    wrapper.load_state_dict(saved)
    assert torch.equal(moe.expert_bias, torch.full_like(moe.expert_bias, 0.5)) and wrapper.recovered == 4
