"""Dry runs of the article's layouts on the meta device: per-rank parameters = total / sharding degrees, up to the
tensors a degree leaves unsharded (norms under TP) and one row of FSDP padding per tensor; invalid layouts exit 2."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from meshforge.cli import main as meshforge
from meshforge.config.io import load_config
from meshforge.model.flavors import ModelArgs, get_flavor, param_counts
from meshforge.tools.dry_run import PipelineRank, compress, format_report, plan


def stage_numel(args: ModelArgs, names: list[str]) -> tuple[int, int, int]:
    """(parameters, of which norm weights (never TP-sharded), tensors) of the named top-level modules."""
    counts = param_counts(args)
    total = norms = tensors = 0
    for name in names:
        if name.startswith("layers."):
            total, norms, tensors = total + counts.per_layer, norms + 2 * args.dim, tensors + 9
        elif name == "norm":
            total, norms, tensors = total + args.dim, norms + args.dim, tensors + 1
        else:  # tok_embeddings, output
            total, tensors = total + args.vocab_size * args.dim, tensors + 1
    return total, norms, tensors


def assert_sharded(rank: PipelineRank, args: ModelArgs, fsdp: int, tp: int) -> None:
    names = [n for _, stage in rank.stages for n in stage]
    total, norms, tensors = stage_numel(args, names)
    ideal = total / (fsdp * tp)
    unsharded_by_tp = norms / fsdp - norms / (fsdp * tp)
    padding = tensors * max(args.dim, args.vocab_size // tp)  # at most one row of dim-0 padding per tensor
    assert ideal + unsharded_by_tp <= rank.param_elements <= ideal + unsharded_by_tp + padding, (rank, ideal)
    assert rank.param_bytes == 4 * rank.param_elements  # fp32 master weights
    assert rank.grad_bytes == rank.param_bytes and rank.optimizer_bytes == 2 * rank.param_bytes


def test_8b_fsdp_8_through_the_cli(capsys) -> None:
    code = meshforge(["train", "--config", "configs/llama3_8b.toml", "--dry-run", "--world-size", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "layout: dp_shard 8 = 8" in out and out.rstrip().endswith("before its first step")
    assert not dist.is_initialized()  # the fake process group is gone
    report = plan(load_config("configs/llama3_8b.toml", []), 8)
    assert [r.pp_rank for r in report.ranks] == [0]
    assert_sharded(report.ranks[0], get_flavor("8B"), fsdp=8, tp=1)


def test_cuda_only_options_are_checked_for_the_target() -> None:
    ring = ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_impl", "ring"]
    report = plan(load_config("configs/llama3_8b.toml", ring), 16)
    assert_sharded(report.ranks[0], get_flavor("8B"), fsdp=16, tp=1)  # FSDP shards over dp_shard x cp
    plan(load_config("configs/llama3_8b.toml", [*ring, "--training.device", "cpu"]), 16)  # ring runs on CPU too
    async_tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel", "true"]
    async_tp += ["--compile.enable", "true"]
    with pytest.raises(ValueError, match="needs CUDA"):
        plan(load_config("configs/llama3_8b.toml", [*async_tp, "--training.device", "cpu"]), 16)
    assert not dist.is_initialized()


def test_70b_fsdp_32_tp_8() -> None:
    report = plan(load_config("configs/llama3_70b.toml", []), 256)
    assert_sharded(report.ranks[0], get_flavor("70B"), fsdp=32, tp=8)
    assert "Replicate: attention_norm, ffn_norm, norm" in report.axes["tp"]


def test_405b_fsdp_8_tp_8_pp_8_on_512_ranks() -> None:
    start = time.process_time()  # CPU seconds: wall time on this shared machine depends on the neighbours
    report = plan(load_config("configs/llama3_405b.toml", []), 512)
    assert time.process_time() - start < 60
    text = format_report(report)
    assert "layout: pp 8 x dp_shard 8 x tp 8 = 512" in text and "16 stages, 2 per rank (Interleaved1F1B)" in text
    args = get_flavor("405B")
    assert [r.pp_rank for r in report.ranks] == list(range(8))
    every_module = [n for r in report.ranks for _, stage in r.stages for n in stage]
    assert stage_numel(args, every_module)[0] == param_counts(args).total  # each module on exactly one stage
    for rank in report.ranks:
        assert [index % 8 for index, _ in rank.stages] == [rank.pp_rank] * 2  # looped: stages p and p + 8
        assert_sharded(rank, args, fsdp=8, tp=8)


@pytest.mark.parametrize(
    ("world", "overrides", "reason"),
    [
        (500, [], "not divisible by"),
        (448, ["--parallelism.tensor_parallel_degree", "7"], "does not divide the model's n_heads"),
        (512, ["--training.local_batch_size", "33"], "needs the microbatch count to be a multiple"),
        (0, [], "--world-size 0"),
    ],
)
def test_invalid_layout_exits_2_with_one_line(world: int, overrides: list[str], reason: str, capsys) -> None:
    argv = ["train", "--config", "configs/llama3_405b.toml", "--dry-run", "--world-size", str(world), *overrides]
    assert meshforge(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshforge train --dry-run: error: ") and reason in err[0], err
    assert not dist.is_initialized()


def test_compress_layer_ranges() -> None:
    assert compress(["tok_embeddings", "layers.0", "layers.1", "layers.2"]) == "tok_embeddings, layers.0-2"
    assert compress(["layers.7", "norm", "output"]) == "layers.7, norm, output"
