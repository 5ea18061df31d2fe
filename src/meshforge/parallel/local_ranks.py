"""Several ranks in one process (``parallelism.local_ranks`` / ``meshforge train --local-ranks N``), with torch's
local-tensor mode (``torch.distributed._local_tensor``): every tensor holds one real value per simulated rank, every
collective is computed from those values in this process, and no process-group traffic exists (the default group is
torch's ``fake`` backend, which only names the world). The step runs the layout's real sharded kernels once per rank,
so a layout's numerics are checked against one process without launching ranks. What runs and where it stops:
docs/parallelism.md ("Several ranks in one process")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from meshforge.errors import ConfigError
from meshforge.parallel.degrees import Degrees, degrees_from_config

if TYPE_CHECKING:  # context_parallel imports this module (each_rank), and dims imports context_parallel
    from meshforge.config.schema import JobConfig

R = TypeVar("R")


def refusal(cfg: JobConfig, dims: Degrees) -> str:
    """Why this job cannot run under local ranks ('' when it can): the features torch's local-tensor mode does not
    carry in torch 2.13, each with the reason."""
    checks = [
        (
            dims.pp > 1,
            "pipeline parallel builds a different model part on each rank and passes activations by point-to-point "
            "ops: one SPMD program holds one model, and torch's LocalRunnerMode (a thread per stage) carries "
            "send / recv but no collective across its threads (the pp-axis gradient norm)",
        ),
        (
            dims.cp > 1 and cfg.parallelism.context_parallel_impl == "ring",
            "context parallel's ring passes K/V rank to rank by point-to-point ops; use "
            "parallelism.context_parallel_impl = 'allgather'",
        ),
        (
            cfg.compile.enable,
            "inductor's compiled code reads tensors' data pointers, and a local tensor has none (torch 2.13: "
            "'Cannot access data pointer of Tensor'); set compile.enable = false",
        ),
        (
            cfg.checkpoint.enable or bool(cfg.checkpoint.initial_load_path) or cfg.checkpoint.create_seed_checkpoint,
            "a distributed checkpoint writes each rank's shards from that rank's process",
        ),
        (cfg.fault_tolerance.enable, "fault tolerance's replica groups are separate processes"),
        (
            cfg.validation.enable,
            "validation's loader is built for one rank's rows, not yet for every simulated rank's",
        ),
    ]
    return next((why for refused, why in checks if refused), "")


@contextlib.contextmanager
def local_world(cfg: JobConfig) -> Iterator[None]:
    """The job's ``parallelism.local_ranks`` ranks simulated in this process: a ``fake`` default process group (rank
    0 of N, no traffic) under torch's LocalTensorMode, both torn down on exit with DTensor's caches of the meshes.
    ConfigError (one line) first when the layout does not fit N ranks or uses what local tensors cannot run."""
    from meshforge.parallel.distributed import clear_dtensor_caches

    ranks = cfg.parallelism.local_ranks
    try:
        from torch.distributed._local_tensor import LocalTensorMode
    except ImportError as exc:
        raise ConfigError(
            f"--local-ranks {ranks} needs torch's local tensors (torch.distributed._local_tensor, torch 2.13), which "
            f"torch {torch.__version__} lacks ({exc}); run the layout with --nproc {ranks}"
        ) from None
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"--local-ranks {ranks} runs every rank in one process: start it without torchrun or --nproc")
    dims = degrees_from_config(cfg.parallelism, ranks)  # ConfigError when the degrees do not multiply to N
    if why := refusal(cfg, dims):
        raise ConfigError(f"--local-ranks {ranks}: {why}; run this layout with --nproc {ranks} instead")
    dist.init_process_group("fake", rank=0, world_size=ranks)
    try:
        with LocalTensorMode(ranks), fsdp_storage_per_rank():
            yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


class RankValues(dict[int, Any]):
    """Each simulated rank's value of something that is not a tensor (``each_rank``'s results)."""


def _value_on(rank: int, value: Any) -> Any:
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor

    if isinstance(value, LocalTensor):
        return value._local_tensors[rank]
    if isinstance(value, torch.SymInt) and isinstance(value.node, LocalIntNode):
        return value.node._local_ints[rank]
    return value[rank] if isinstance(value, RankValues) else value


def each_rank(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn`` unchanged, except under local ranks: there it runs once per simulated rank, on that rank's values of
    its arguments (a local tensor's shard, a per-rank int, a RankValues entry, in nested lists and tuples too), and
    its results are put back together item by item: tensors as local tensors, anything else as RankValues. For rank-
    dependent code with no collective inside (context parallel's block choice: a different slice on each rank)."""
    import functools

    from torch.utils._pytree import tree_map

    try:
        from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode
    except ImportError:  # a torch without local tensors: --local-ranks is refused, fn runs as it is
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        mode = enabled_local_tensor_mode()
        if mode is None:
            return fn(*args)
        with mode.disable():
            results: dict[int, Any] = {
                r: fn(*tree_map(functools.partial(_value_on, r), args)) for r in sorted(mode.ranks)
            }
            single = not isinstance(next(iter(results.values())), tuple)
            rows: dict[int, tuple[Any, ...]] = {r: (res,) if single else tuple(res) for r, res in results.items()}
            joined = []
            for i, item in enumerate(rows[min(rows)]):
                per_rank = {r: row[i] for r, row in rows.items()}
                tensor = isinstance(item, torch.Tensor)
                joined.append(LocalTensor(per_rank) if tensor else RankValues(per_rank))  # type: ignore[arg-type]
        return joined[0] if single else tuple(joined)

    return wrapper  # type: ignore[return-value]


def rank_zero(tensor: torch.Tensor) -> torch.Tensor:
    """Simulated rank 0's value of a local tensor (what rank 0's process would hold: this process is rank 0); any
    other tensor as it is."""
    from torch.distributed._local_tensor import LocalTensor

    return tensor._local_tensors[0] if isinstance(tensor, LocalTensor) else tensor


def _per_rank_storage(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``tensor``: each simulated rank's for a local tensor (which has none of its own)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(tensor, LocalTensor):
        return [t.untyped_storage() for t in tensor._local_tensors.values()]
    return [tensor.untyped_storage()]


def alloc_storage(tensor: torch.Tensor) -> None:
    """FSDP2's ``alloc_storage``, on every simulated rank's storage."""
    size = tensor.numel() * tensor.itemsize
    for storage in _per_rank_storage(tensor):
        if storage.size() != size:
            storage.resize_(size)


def free_storage(tensor: torch.Tensor) -> None:
    """FSDP2's ``free_storage``, on every simulated rank's storage."""
    for storage in _per_rank_storage(tensor):
        if storage.size() != 0:
            storage.resize_(0)


@contextlib.contextmanager
def fsdp_storage_per_rank() -> Iterator[None]:
    """FSDP2 frees a gathered parameter after use and re-allocates it before the next all-gather by resizing its
    storage (``untyped_storage().resize_``); a local tensor is a wrapper with no storage of its own, so torch 2.13
    raises "Attempted to call resize_() on an invalid python storage". Inside this context FSDP2's two helpers resize
    each simulated rank's storage instead: the same memory life cycle, rank by rank."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    saved = _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc_storage, free_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage = saved
