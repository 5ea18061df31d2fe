"""User mistakes are ConfigError (one line, exit 2); every other error keeps its traceback; only real collective
timeouts and lost peers count as hangs."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from meshforge.config.io import ConfigError, load_config
from meshforge.config.schema import Parallelism
from meshforge.errors import ConfigError as BaseConfigError
from meshforge.model.flavors import get_flavor
from meshforge.observability.hang import is_collective_failure
from meshforge.parallel.dims import ParallelDims
from meshforge.train import cli as train_cli


def test_one_config_error_type() -> None:
    assert ConfigError is BaseConfigError and issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "mistake",
    [
        lambda: get_flavor("no-such-flavor"),
        lambda: ParallelDims.from_config(Parallelism(tensor_parallel_degree=0), 4),
        lambda: ParallelDims.from_config(Parallelism(tensor_parallel_degree=3), 4),
        lambda: load_config(None, ["--optimizer.lr", "-1"]),
    ],
)
def test_user_mistakes_raise_config_error(mistake: object) -> None:
    with pytest.raises(ConfigError):
        mistake()  # type: ignore[operator]


def test_train_cli_exits_2_on_config_error_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import meshforge.train.loop as loop

    cfg = load_config(None, [])

    def user_mistake(cfg: object) -> None:
        raise ConfigError("training.x = 1 is wrong; use 2")

    monkeypatch.setattr(loop, "train", user_mistake)
    assert train_cli.run(cfg) == 2
    err = capsys.readouterr().err
    assert err.strip() == "meshforge train: error: training.x = 1 is wrong; use 2"

    def torch_bug(cfg: object) -> None:
        raise ValueError("Expected a tensor of shape (2, 3) but got (3, 2)")  # what torch raises: not a user error

    monkeypatch.setattr(loop, "train", torch_bug)
    with pytest.raises(ValueError, match="Expected a tensor"):  # keeps its traceback, no exit 2
        train_cli.run(cfg)


@pytest.mark.parametrize(
    ("error", "hang"),
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 100000ms for recv operation"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"), True),
        (
            dist.DistBackendError(
                "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for "
                "100012 milliseconds before timing out."
            ),
            True,
        ),
        (RuntimeError("NCCL communicator was aborted on rank 3."), True),
        (dist.DistNetworkError("connection to the store failed"), True),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, Duplicate GPU detected"), False),
        (dist.DistBackendError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"), False),
        (RuntimeError("CUDA error: an illegal memory access was encountered (NCCL kernel)"), False),
        (ValueError("timed out"), False),
        (None, False),
    ],
)
def test_only_timeouts_and_lost_peers_are_hangs(error: BaseException | None, hang: bool) -> None:
    assert is_collective_failure(error) is hang
