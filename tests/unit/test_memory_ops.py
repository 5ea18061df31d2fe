"""`--dry-run --memory --by-op` (tools/memory_ops.py): each saved storage once, parameters left out, the CLI record."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

from meshforge.cli import main as meshforge
from meshforge.config.io import load_config
from meshforge.model.flavors import FLAVORS
from meshforge.model.hf_config import resolve_model_args
from meshforge.model.llama import build_model
from meshforge.parallel.dims import ParallelDims
from meshforge.tools.memory_ops import SaveRecorder, saved_by_op

TINY = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "2"]


def graph_saved_bytes(root: torch.Tensor, params: set[int]) -> int:
    """Bytes of the distinct storages the autograd graph behind ``root`` holds (the ``_saved_*`` attributes of every
    node, ``saved_tensors`` of custom functions), parameters left out: the recorder's total found another way."""
    seen: dict[int, int] = {}
    stack, visited = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        custom = ["saved_tensors"] if isinstance(node, BackwardCFunction) else []  # custom autograd functions
        for name in [n for n in dir(node) if n.startswith("_saved_")] + custom:
            value = getattr(node, name)
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return sum(seen.values())


def test_recorder_counts_every_saved_storage_once_without_parameters() -> None:
    args = dataclasses.replace(FLAVORS["tiny"], n_layers=2, max_seq_len=64)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    recorder = SaveRecorder()
    with recorder.recording(model):
        logits = model(tokens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    recorded = sum(row.nbytes for row in recorder.rows.values())
    assert recorded == graph_saved_bytes(logits, params) > 0
    # wq, wk and wv save one normed input: one storage, attributed to the first module saving it
    first = {key[0] for key in recorder.rows}
    assert "layers.1.attention.wq" in first and "layers.1.attention.wk" not in first
    assert not any(
        isinstance(m, nn.Linear) and m.weight.shape == row.shape
        for m in model.modules()
        for row in recorder.rows.values()
    )
    assert not recorder.modules  # every module popped


def test_sequence_parallel_block_saves_the_sequence_shard_not_the_gathered_input() -> None:
    """Under SP the q/k/v and w1/w3 inputs are saved as the sequence shard (parallel/sequence_shard_saves.py): one
    (batch, seq / tp, dim) storage each, no gathered (batch x seq, dim) one; the weights' local shards are no rows."""
    flags = ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "none"]
    cfg = load_config(None, [*TINY, *flags, "--training.mixed_precision_param", "float32"])  # bf16: autocast's casts
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    saved = saved_by_op(cfg, 2, args, ParallelDims.from_config(cfg.parallelism, 2))
    for module in ("attention", "feed_forward"):
        shards = [r for r in saved.block if r.module == module and r.made_by == "_ToTorchTensorBackward"]
        assert [(r.shape, r.count) for r in shards] == [((2, 32, 64), 1)], saved.block
    assert not [r for r in saved.block if r.made_by == "RedistributeBackward" or r.shape == (128, 64)]
    assert saved.tokens == (2, 64)
    assert saved.block_bytes == sum(r.nbytes for r in saved.block) > 0
    assert all(not r.module.startswith("layers.") for r in saved.outside)


def test_cli_by_op_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--dry-run", "--by-op", "--json", "--world-size", "2", *TINY]
    assert meshforge(argv) == 0
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    assert "peak_gib" not in record  # --by-op alone: no peak run
    saved = record["saved_by_op"]
    assert saved["block_mib"] == pytest.approx(sum(r["mib"] for r in saved["block_rows"]), abs=0.01)
    assert "activation_checkpoint.mode = selective: the checkpoint holds" in out  # the default mode: a note


def test_context_parallel_wo_input_is_a_view_of_the_saved_attention_output() -> None:
    """The CP cores lay their output out (batch, seq, heads, head_dim): wo's input is then the saved output's view,
    not a second saved copy (parallel/context_parallel/blocks.py cat_seq_major)."""
    cp2 = ["--parallelism.context_parallel_degree", "2", "--activation_checkpoint.mode", "none"]
    cfg = load_config(None, [*TINY, *cp2, "--training.mixed_precision_param", "bfloat16"])
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    saved = saved_by_op(cfg, 2, args, ParallelDims.from_config(cfg.parallelism, 2))
    modules = {r.module for r in saved.block}
    assert "attention.sdpa" in modules and "attention.wo" not in modules


def test_by_op_without_dry_run_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert meshforge(["train", "--by-op", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--by-op" in err[0] and "--dry-run" in err[0]


def test_lean_saves_false_keeps_dtensors_gathered_saves_under_sequence_parallel() -> None:
    flags = ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "none"]
    cfg = load_config(
        None, [*TINY, *flags, "--training.mixed_precision_param", "float32", "--model.lean_saves", "false"]
    )  # float32: without FSDP a bf16 run is autocast's, whose cast copy of the gathered input is what the matmul saves
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    saved = saved_by_op(cfg, 2, args, ParallelDims.from_config(cfg.parallelism, 2))
    gathered = [(r.module, r.made_by, r.shape) for r in saved.block if r.made_by == "RedistributeBackward"]
    assert gathered == [
        ("attention.wq", "RedistributeBackward", (128, 64)),
        ("feed_forward.w1", "RedistributeBackward", (128, 64)),
    ]


def test_one_rank_bf16_saves_what_autocast_saves() -> None:
    """Without FSDP a bf16 run computes under autocast (device/precision.py): the exact step does too, so the block
    saves its matmul outputs in bf16 and autocast's cast weights, not fp32 activations (it once traced fp32: Llama
    3.2 1B AC none 44.2 GiB instead of 39.7)."""
    flags = ["--activation_checkpoint.mode", "none", "--training.mixed_precision_param", "bfloat16"]
    cfg = load_config(None, [*TINY, *flags])
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    saved = saved_by_op(cfg, 1, args, ParallelDims.from_config(cfg.parallelism, 1))
    gate = [r for r in saved.block if r.module == "feed_forward.w2" and r.made_by == "_SiluMulBackward"]
    assert [r.dtype for r in gate] == ["bfloat16"], saved.block
    assert any(r.made_by == "ToCopyBackward0" and r.module == "feed_forward.w1" for r in saved.block), saved.block
