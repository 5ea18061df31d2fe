"""Checkpointer in one process (no process group): round trip of the whole state, atomic commit and clean-up,
retention, and bad input (truncated, corrupted, crafted, other flavor) failing in one line that names the file."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from meshforge.checkpoint import store as store
from meshforge.checkpoint.dcp import FLAT, Checkpointer, model_view
from meshforge.config.schema import Checkpoint, LRScheduler, Optimizer
from meshforge.data.loader import PackedDataLoader
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model
from meshforge.parallel.distributed import DistContext
from meshforge.train.loop import TrainState, checkpoint_states
from meshforge.train.optim import build_lr_scheduler, build_optimizer

TOKENS = np.arange(4000, dtype=np.int32) % 2048


def make_state(seed: int, flavor: str = "tiny") -> TrainState:
    model = build_model(get_flavor(flavor).with_seq_len(32))
    model.to_empty(device="cpu")
    model.init_weights(seed)
    optimizer = build_optimizer([model], Optimizer())
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=2), 10)
    loader = PackedDataLoader(TOKENS, seq_len=32, local_batch_size=2, dp_rank=0, dp_degree=1, seed=seed % 2)
    none: Any = None
    args = get_flavor(flavor).with_seq_len(32)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    return TrainState(none, ctx, none, None, args, [model], optimizer, scheduler, loader, none)


def load(ck: Checkpointer, state: TrainState) -> None:
    """Resume ``state`` as the training loop does."""
    state.step = ck.load(checkpoint_states(state))


def take_steps(state: TrainState, steps: int) -> None:
    """Optimizer steps with made-up gradients, so the optimizer state and schedule are not trivial."""
    for _ in range(steps):
        for p in state.model_parts[0].parameters():
            p.grad = torch.randn_like(p)
        state.optimizer.step()
        state.scheduler.step()
        state.loader.next_batch()
        state.step += 1


def checkpointer(folder: Path, **cfg: Any) -> Checkpointer:
    return Checkpointer(
        Checkpoint(**{"enable": True, "interval": 2, **cfg}),
        dump_folder=str(folder),
        total_steps=10,
        info={"flavor": "tiny", "layout": "one process"},
        device=torch.device("cpu"),
        timeout_s=60,
        console=False,
    )


def saved(tmp_path: Path, steps: int = 4) -> tuple[TrainState, Path]:
    state = make_state(seed=1)
    take_steps(state, steps)
    ck = checkpointer(tmp_path)
    ck.save(checkpoint_states(state), state.step)
    ck.close()
    return state, tmp_path / "checkpoint" / f"step-{steps}"


def load_error(tmp_path: Path, flavor: str = "tiny") -> str:
    with pytest.raises(ValueError) as info:
        load(checkpointer(tmp_path), make_state(seed=2, flavor=flavor))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_round_trip_restores_the_whole_state(tmp_path: Path) -> None:
    state, _ = saved(tmp_path)
    rng = torch.get_rng_state()
    torch.manual_seed(123)
    fresh = make_state(seed=2)
    fresh.loader.seed = state.loader.seed
    load(checkpointer(tmp_path), fresh)
    assert fresh.step == 4 and fresh.loader.global_position == state.loader.global_position
    assert fresh.scheduler.last_epoch == 4 and fresh.scheduler.get_last_lr() == state.scheduler.get_last_lr()
    assert fresh.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    want, got = get_model_state_dict(state.model_parts[0]), get_model_state_dict(fresh.model_parts[0])
    assert all(torch.equal(want[k], got[k]) for k in want)
    want = get_optimizer_state_dict(state.model_parts[0], state.optimizer, options=FLAT)
    got = get_optimizer_state_dict(fresh.model_parts[0], fresh.optimizer, options=FLAT)
    assert all(torch.equal(want[k], got[k]) for k in want if k.startswith("state."))
    assert torch.equal(torch.get_rng_state(), rng)


def test_commit_is_atomic_and_incomplete_ones_are_removed(tmp_path: Path) -> None:
    _, path = saved(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meshforge.json"]
    partial = path.parent / "step-6.tmp"
    shutil.copytree(path, partial)
    (partial / "meshforge.json").unlink()
    fresh = make_state(seed=2)
    fresh.loader.seed = 1
    load(checkpointer(tmp_path), fresh)
    assert fresh.step == 4 and not partial.exists()


def test_keep_latest_k_and_load_step(tmp_path: Path) -> None:
    state = make_state(seed=1)
    ck = checkpointer(tmp_path, keep_latest_k=2)
    for _ in range(3):
        take_steps(state, 2)
        ck.maybe_save(checkpoint_states(state), state.step)
    ck.close()
    assert store.complete_steps(tmp_path / "checkpoint") == [4, 6]
    fresh = make_state(seed=2)
    fresh.loader.seed = 1
    load(checkpointer(tmp_path, load_step=4), fresh)
    assert fresh.step == 4
    message = load_error_with(tmp_path, load_step=2)
    assert "checkpoint.load_step = 2" in message and "[4, 6]" in message


def load_error_with(tmp_path: Path, **cfg: Any) -> str:
    with pytest.raises(ValueError) as info:
        load(checkpointer(tmp_path, **cfg), make_state(seed=2))
    return str(info.value)


def test_async_save_is_the_same_checkpoint(tmp_path: Path) -> None:
    state = make_state(seed=1)
    take_steps(state, 2)
    at_save = {k: v.clone() for k, v in get_model_state_dict(state.model_parts[0]).items()}
    ck = checkpointer(tmp_path, async_mode="async")
    ck.maybe_save(checkpoint_states(state), state.step)
    take_steps(state, 1)  # training changes the parameters in place while the staged copy is written
    ck.close()
    fresh = make_state(seed=2)
    fresh.loader.seed = 1
    load(checkpointer(tmp_path), fresh)
    got = get_model_state_dict(fresh.model_parts[0])
    assert fresh.step == 2 and all(torch.equal(got[k], at_save[k]) for k in at_save)


def test_truncated_file_is_named(tmp_path: Path) -> None:
    _, path = saved(tmp_path)
    data = path / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    message = load_error(tmp_path)
    assert f"{data} is truncated" in message and "delete" in message


def test_corrupted_file_is_named(tmp_path: Path) -> None:
    _, path = saved(tmp_path)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert f"{data} is corrupted" in load_error(tmp_path)


def test_crafted_metadata_is_not_executed(tmp_path: Path) -> None:
    _, path = saved(tmp_path)
    (path / "meshforge.json").unlink()  # no manifest: the metadata itself is parsed (as for foreign checkpoints)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    state = make_state(seed=2)
    with pytest.raises(ValueError, match=r"\.metadata is unreadable .*not a DCP metadata type"):
        load(checkpointer(tmp_path, enable=False, initial_load_path=str(path)), state)
    assert not marker.exists()


def test_other_flavor_names_the_keys(tmp_path: Path) -> None:
    _, path = saved(tmp_path)
    message = load_error(tmp_path, flavor="debugmodel")
    assert str(path / ".metadata") in message
    assert "model.tok_embeddings.weight saved (2048, 64) vs model (2048, 256)" in message
    assert "unexpected model.layers.6" in message  # tiny has 8 layers, debugmodel 6


def test_final_save_is_resumable_with_a_model_only_export_beside_it(tmp_path: Path) -> None:
    state = make_state(seed=1)
    ck = checkpointer(tmp_path, export_dtype="bfloat16", interval=100)
    take_steps(state, 10)
    ck.maybe_save(checkpoint_states(state), state.step)  # the last step: full state + the export
    ck.close()
    full = store.read_manifest(tmp_path / "checkpoint/step-10")
    assert full is not None and not full["model_only"] and full["dtype"] == "float32"
    export = tmp_path / "checkpoint/export/step-10"
    manifest = store.read_manifest(export)
    assert manifest is not None and manifest["model_only"] and manifest["dtype"] == "bfloat16"
    saved_keys = store.saved_shapes(store.read_metadata(export))
    assert saved_keys and all(k.startswith("model.") for k in saved_keys)
    assert store.complete_steps(tmp_path / "checkpoint") == [10]  # the export is not a resume candidate
    fresh = make_state(seed=2)
    fresh.loader.seed = 1
    load(checkpointer(tmp_path), fresh)  # a finished run: the whole state at step 10 (nothing left to train)
    assert fresh.step == 10 and fresh.scheduler.last_epoch == 10
    weight = state.model_parts[0].output.weight  # type: ignore[union-attr]
    assert torch.equal(fresh.model_parts[0].output.weight, weight)  # type: ignore[union-attr]
    exported = make_state(seed=2)
    load(checkpointer(tmp_path / "new", enable=False, initial_load_path=str(export.parent)), exported)
    got = exported.model_parts[0].output.weight  # type: ignore[union-attr]
    assert exported.step == 0 and torch.equal(got, weight.detach().bfloat16().float())


def test_model_only_checkpoint_cannot_resume_a_longer_run(tmp_path: Path) -> None:
    state = make_state(seed=1)
    take_steps(state, 4)
    ck = checkpointer(tmp_path)
    ck.save(checkpoint_states(state), state.step, model_only=True)
    ck.close()
    message = load_error(tmp_path)
    assert "holds only model weights" in message and "initial_load_path" in message


def test_unsupported_async_mode_on_cpu(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="async_with_pinned_mem' needs CUDA"):
        checkpointer(tmp_path, async_mode="async_with_pinned_mem")


def test_model_view_of_pipeline_stages_has_the_full_names() -> None:
    full = make_state(seed=1).model_parts[0]
    stages = [build_model(get_flavor("tiny").with_seq_len(32)) for _ in range(2)]
    for stage, keep in zip(stages, (range(0, 4), range(4, 8)), strict=True):
        stage.to_empty(device="cpu")
        stage.init_weights(1)
        for name in [n for n in stage.layers if int(n) not in keep]:
            del stage.layers[name]
    stages[0].norm = stages[0].output = None
    stages[1].tok_embeddings = None
    view = model_view(stages)
    assert list(get_model_state_dict(view)) == list(get_model_state_dict(full))
    optimizer = build_optimizer(stages, Optimizer())  # one optimizer over both stages, as the loop builds it
    keys = get_optimizer_state_dict(view, optimizer, options=FLAT)
    assert "state.layers.7.attention.wq.weight.exp_avg" in keys and "state.tok_embeddings.weight.step" in keys


def test_initial_weights_from_hugging_face_or_a_checkpoint_folder(tmp_path: Path) -> None:
    from meshforge.checkpoint import hf as hf_interop

    source, _ = saved(tmp_path / "run")
    weights = {k: v.detach().clone() for k, v in get_model_state_dict(source.model_parts[0]).items()}
    hf_interop.save_hf(weights, source.model_args, tmp_path / "hf", dtype="float32")
    for path in (tmp_path / "hf", tmp_path / "run/checkpoint"):  # a folder of step-N: its latest step
        fresh = make_state(seed=2)
        load(checkpointer(tmp_path / "new", enable=False, initial_load_path=str(path)), fresh)
        got = get_model_state_dict(fresh.model_parts[0])
        assert fresh.step == 0 and all(torch.equal(got[k], weights[k]) for k in weights)
