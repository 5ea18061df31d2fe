"""The collective counter (device/collective_counter.py) and the gradient-exchange bytes it counts, in one process on a
fake process group (no communication; issue 43 item 8: "figures checked only as a ratio", "modules with no unit
test"). tests/distributed/test_gradient_sync.py proves GA 4 exchanges what GA 1 does and every_microstep 4x that: a
ratio, which a counter that drops the element size, or counts the reduce-scatter's output instead of its input,
still meets. Here the bytes are absolute, written out from the tiny flavor's shapes."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from fakeworld import fake_rank
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.config.io import load_config
from meshforge.device.collective_counter import CollectiveCounter, axis_names
from meshforge.model.flavors import get_flavor
from meshforge.parallel.dims import FLATTENED
from meshforge.parallel.distributed import DistContext
from meshforge.train import loop

TRAIN = [
    "--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "1", "--training.device", "cpu",
    "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
]  # fmt: skip
GA1 = ["--training.local_batch_size", "4"]
GA4 = ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "4", "--gradient_sync.mode"]
GA4 += ["once_per_step"]  # auto runs a run's first step every micro-step and measures it (train/grad_accum.py)
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]


@pytest.fixture
def mesh_2x2() -> Iterator[DeviceMesh]:
    """Rank 0 of a fake 4-rank group, as a dp_shard 2 x tp 2 mesh (dp_shard x tp flattened too)."""
    with fake_rank(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
        yield mesh


def test_each_collective_counts_its_input_bytes_and_calls_per_axis(mesh_2x2: DeviceMesh) -> None:
    """Bytes are what one rank hands in: the all-reduce's buffer, the reduce-scatter's full input (2x its output),
    the all-gather's local shard (half its output), element size included; positional and keyword alike; the
    world's collectives as "world"; the originals back after the block."""
    shard = mesh_2x2["dp_shard"].get_group()
    original = dist.all_reduce
    with CollectiveCounter(axis_names(mesh_2x2)) as counter:
        dist.all_reduce(torch.ones(6))  # world: 24 bytes
        dist.all_reduce(tensor=torch.ones(10, dtype=torch.bfloat16), group=shard)  # 20 bytes
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6), group=shard)  # its input 24, not its output 12
        dist.all_gather_into_tensor(torch.empty(8, dtype=torch.float64), torch.ones(4, dtype=torch.float64), shard)
        dist.all_gather_into_tensor(output_tensor=torch.empty(8), input_tensor=torch.ones(4), group=shard)  # 16
    assert dist.all_reduce is original
    assert counter.table() == {
        ("all_gather", "dp_shard"): (2, 32 + 16),
        ("all_reduce", "dp_shard"): (1, 20),
        ("all_reduce", "world"): (1, 24),
        ("reduce_scatter", "dp_shard"): (1, 24),
    }


def test_functional_collectives_count_once_on_their_groups_axis(mesh_2x2: DeviceMesh) -> None:
    """DTensor's and expert parallel's functional collectives, by the group's axis however it is named ((mesh, dim),
    a 1-D mesh, a process group), each call once: the deprecated ``*_tensor`` aliases call the ``*_single``
    functions (torch 2.12+), both patched, and a call must not count twice."""
    tp = mesh_2x2["tp"]
    original = funcol.all_gather_single
    with warnings.catch_warnings(), CollectiveCounter(axis_names(mesh_2x2, ["dp_shard_tp"])) as counter:
        warnings.simplefilter("ignore", FutureWarning)
        out = [
            funcol.all_reduce(torch.ones(5), "sum", (mesh_2x2, 1)),  # tp: 20 bytes
            funcol.all_gather_single(torch.ones(2, 3), 0, tp),  # tp: 24 bytes
            funcol.all_gather_tensor(torch.ones(3), 0, tp.get_group()),  # the deprecated alias: 12 bytes, once
            funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, mesh_2x2["dp_shard_tp"]),  # 16 bytes, once
        ]
        for tensor in out:
            funcol.wait_tensor(tensor)
    assert funcol.all_gather_single is original
    assert counter.table() == {
        ("all_gather", "tp"): (2, 24 + 12),
        ("all_reduce", "tp"): (1, 20),
        ("reduce_scatter", "dp_shard_tp"): (1, 16),
    }


def test_axis_names_name_each_dim_of_a_2d_mesh_and_its_flattened_axis(mesh_2x2: DeviceMesh) -> None:
    """Each 1-D group by its own axis; a flattened axis the layout built; a group of no axis is "other"."""
    names = axis_names(mesh_2x2, ["dp_shard_tp", "cp"])  # cp: not built here, skipped
    groups = {axis: mesh_2x2[axis].get_group().group_name for axis in ("dp_shard", "tp", "dp_shard_tp")}
    assert names == {groups[a]: a for a in groups} and len(set(groups.values())) == 3
    lone = dist.new_group([0, 1])
    with CollectiveCounter(names) as counter:
        dist.all_reduce(torch.ones(2), group=mesh_2x2["tp"].get_group())
        dist.broadcast(torch.ones(3), src=0, group=lone)
    assert counter.table() == {("all_reduce", "tp"): (1, 8), ("broadcast", "other"): (1, 12)}
    assert axis_names(None) == {}


def tiny_numel() -> tuple[int, int]:
    """(parameters of the tiny flavor, of one transformer block) from its shapes, by hand: per block q and o dim x
    dim, k and v dim x kv_dim, SwiGLU 3 x dim x hidden (hidden = 2/3 x 4 dim rounded up to multiple_of), two norms;
    the embedding and the untied head vocab x dim, the final norm."""
    a = get_flavor("tiny")
    head_dim = a.dim // a.n_heads
    kv = a.n_kv_heads * head_dim
    hidden = -(-(2 * 4 * a.dim // 3) // a.multiple_of) * a.multiple_of
    block = 2 * a.dim * a.dim + 2 * a.dim * kv + 3 * a.dim * hidden + 2 * a.dim
    assert (a.dim, kv, hidden, a.n_layers, a.vocab_size) == (64, 32, 192, 8, 2048)  # the figures below
    return a.n_layers * block + 2 * a.vocab_size * a.dim + a.dim, block


def one_step(world: int, overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], Any]:
    """Rank 0 of a fake ``world``-rank group: set up the real job and count the collectives of one train_step."""
    ctx = DistContext(0, world, 0, torch.device("cpu"), "fake")
    with fake_rank(0, world), tempfile.TemporaryDirectory(prefix="meshforge-test-") as dump:
        monkeypatch.setattr(loop, "init_distributed", lambda *a, **k: ctx)
        state = loop.setup(load_config(None, [*TRAIN, "--job.dump_folder", dump, *overrides]))
        with CollectiveCounter(axis_names(state.mesh, FLATTENED)) as counter:
            loop.train_step(state)
        return counter.table()


def test_fsdp_gradient_exchange_bytes_from_the_model_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP 2, fp32: one reduce-scatter per FSDP unit (8 blocks + the root) of every parameter's fp32 gradient
    (656,448 x 4 = 2,625,792 bytes) per optimizer step at GA 1 and at GA 4 (once per step), 4x at every_microstep;
    each forward all-gathers every local half (1,312,896 bytes), each backward every block but the last (kept
    gathered) and the root."""
    total, block = tiny_numel()
    root = total - 8 * block
    rs = (9, 4 * total)
    forward = 4 * total // 2
    backward = 4 * (7 * block + root) // 2
    ga1 = one_step(2, GA1, monkeypatch)
    assert ga1[("reduce_scatter", "dp_shard")] == rs == (9, 2_625_792)
    assert ga1[("all_gather", "dp_shard")] == (9 + 8, forward + backward) == (17, 1_312_896 + 1_214_336)
    ga4 = one_step(2, GA4, monkeypatch)
    assert ga4[("reduce_scatter", "dp_shard")] == rs
    assert ga4[("all_gather", "dp_shard")] == (4 * 17, 4 * (forward + backward))
    every = one_step(2, [*GA4[:-1], "every_microstep"], monkeypatch)
    assert every[("reduce_scatter", "dp_shard")] == (4 * 9, 4 * rs[1])


def test_hsdp_all_reduces_the_reduce_scattered_half_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """HSDP 2 x 2 at GA 4: the reduce-scatter over dp_shard as FSDP 2's, then one all-reduce per unit over
    dp_replicate of its half (1,312,896 bytes), once per optimizer step."""
    total, _ = tiny_numel()
    table = one_step(4, [*GA4, *HSDP], monkeypatch)
    assert table[("reduce_scatter", "dp_shard")] == (9, 4 * total)
    assert table[("all_reduce", "dp_replicate")] == (9, 4 * total // 2) == (9, 1_312_896)
