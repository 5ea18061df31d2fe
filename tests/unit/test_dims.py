"""ParallelDims validation: every user mistake is a one-line ValueError naming the key, the value and the fix."""

from __future__ import annotations

import pytest
import torch

from meshforge.cli import main as cli_main
from meshforge.config.schema import Float8, Parallelism
from meshforge.model.flavors import ModelArgs, get_flavor
from meshforge.parallel.context_parallel import resolve_cp_impl
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.float8 import check_capability
from meshforge.parallel.layout import Layout

CPU = torch.device("cpu")


def dims(world: int, **degrees: int) -> ParallelDims:
    return ParallelDims.from_config(Parallelism(**degrees), world)  # type: ignore[arg-type]


def one_line_error(match: str) -> pytest.RaisesContext[ValueError]:
    return pytest.raises(ValueError, match=match)


def test_shard_degree_fills_the_rest() -> None:
    d = dims(8, tensor_parallel_degree=2, context_parallel_degree=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (1, 1, 2, 2, 2)
    assert d.fsdp_enabled and d.dp == 2 and d.non_data_parallel_size == 4


def test_non_data_parallel_size_counts_every_model_axis() -> None:
    d = dims(24, pipeline_parallel_degree=3, tensor_parallel_degree=2, data_parallel_replicate_degree=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (3, 2, 2, 1, 2)
    assert d.non_data_parallel_size == 3 * 2, "tokens/s divisor: the ranks of one replica are pp x cp x tp"
    assert dims(16, pipeline_parallel_degree=2, context_parallel_degree=2).non_data_parallel_size == 4
    assert dims(8, data_parallel_replicate_degree=2).non_data_parallel_size == 1


def test_product_must_equal_world_size() -> None:
    with one_line_error(r"dp_shard 3 x cp 1 x tp 2 = 6 but the world size is 4; make the product equal"):
        dims(4, tensor_parallel_degree=2, data_parallel_shard_degree=3)
    with one_line_error(r"world size 6 is not divisible by .* = 4; change the degrees"):
        dims(6, tensor_parallel_degree=4)


@pytest.mark.parametrize("key", ["tensor_parallel_degree", "context_parallel_degree", "data_parallel_replicate_degree"])
def test_degree_below_one(key: str) -> None:
    with one_line_error(rf"parallelism.{key} = 0 must be >= 1"):
        dims(2, **{key: 0})
    with one_line_error(r"data_parallel_shard_degree = -2 must be >= 1 or -1"):
        dims(2, data_parallel_shard_degree=-2)


@pytest.mark.parametrize(
    ("args", "tp", "key"),
    [
        (ModelArgs(dim=96, n_heads=6, n_kv_heads=6, multiple_of=32), 4, "n_heads"),
        (get_flavor("tiny"), 4, "n_kv_heads"),  # 4 heads but 2 kv heads
        (ModelArgs(dim=64, n_heads=8, n_kv_heads=8, multiple_of=36), 8, "ffn hidden dim"),  # ffn 180
    ],
)
def test_tp_must_divide_heads_kv_heads_and_ffn(args: ModelArgs, tp: int, key: str) -> None:
    with one_line_error(rf"tensor_parallel_degree = {tp} does not divide the model's {key} .*; choose"):
        Layout(dims(tp, tensor_parallel_degree=tp), seq_len=64).check(args)


def test_cp_needs_seq_len_divisible_by_two_cp() -> None:
    Layout(dims(2, context_parallel_degree=2), seq_len=64).check(get_flavor("tiny"))
    with one_line_error(r"training.seq_len = 66 must be divisible by 2 x context_parallel_degree = 4"):
        Layout(dims(2, context_parallel_degree=2), seq_len=66).check(get_flavor("tiny"))
    eight_heads = ModelArgs(dim=64, n_heads=8, n_kv_heads=8, multiple_of=32)
    with one_line_error(r"seq_len = 68 must be divisible by context_parallel_degree x tensor_parallel_degree = 8"):
        Layout(dims(8, context_parallel_degree=2, tensor_parallel_degree=4), seq_len=68).check(eight_heads)


def test_async_tp_is_refused_where_it_cannot_work() -> None:
    asked = Parallelism(enable_async_tensor_parallel=True, tensor_parallel_degree=2)
    tp2 = dims(2, tensor_parallel_degree=2)
    with one_line_error(r"async tensor parallel needs CUDA symmetric memory, the device is cpu; set parallelism"):
        tp2.validate_features(asked, device=CPU, compile_enabled=True, float8=Float8())
    with one_line_error(r"needs compile.enable = true"):
        tp2.validate_features(asked, device=torch.device("cuda"), compile_enabled=False, float8=Float8())
    with one_line_error(r"needs parallelism.tensor_parallel_degree > 1"):
        dims(1).validate_features(asked, device=CPU, compile_enabled=True, float8=Float8())


def test_auto_cp_picks_allgather_and_ring_runs_on_any_device() -> None:
    assert resolve_cp_impl("auto", "cpu") == "allgather"
    assert resolve_cp_impl("auto", "cuda") == "allgather"
    assert resolve_cp_impl("ring", "cpu") == "ring"  # our own ring (point-to-point over gloo or NCCL)
    ring = Parallelism(context_parallel_degree=2, context_parallel_impl="ring")
    dims(2, context_parallel_degree=2).validate_features(ring, device=CPU, compile_enabled=False, float8=Float8())
    with one_line_error(r"context_parallel_impl = 'mesh' is unknown; use 'auto', 'allgather' or 'ring'"):
        resolve_cp_impl("mesh", "cpu")
    with one_line_error(r"context_parallel_impl = 'ring' cannot run inside compiled blocks .*compile.enable = false"):
        dims(2, context_parallel_degree=2).validate_features(ring, device=CPU, compile_enabled=True, float8=Float8())


def test_float8_needs_compute_capability_8_9() -> None:
    with one_line_error(r"needs CUDA compute capability >= 8.9 but A100 has 8.0; set it to false"):
        check_capability((8, 0), "A100")
    check_capability((8, 9), "L40S")
    check_capability((9, 0), "H100")


def test_cli_reports_a_bad_layout_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--nproc", "2", "--model.flavor", "tiny", "--parallelism.tensor_parallel_degree", "4"]
    assert cli_main([*argv, "--parallelism.data_parallel_shard_degree", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tp 4 = 4 but the world size is 2" in err, err
