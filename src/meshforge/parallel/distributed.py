"""Process-group life cycle: pick the device and backend, bounded timeouts, a clean exit on every rank."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from meshforge.errors import ConfigError

LOCAL_BACKEND = "local tensors"  # DistContext.backend of --local-ranks (parallel/local_ranks.py)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group


def pick_device(requested: str, local_rank: int) -> torch.device:
    """cuda when available (or asked for), else cpu."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "training.device = 'cuda' but no CUDA device is visible; use training.device = 'cpu' or 'auto'"
        )
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_group_backend(device: torch.device, cuda_backend: str, cpu_offload: bool) -> str:
    """The process group's backend: gloo on a CPU; on CUDA ``cuda_backend``, with a gloo CPU backend beside NCCL
    under CPU offload (the gradient norm is reduced over host-side gradient shards: parallel/cpu_offload.py)."""
    if device.type != "cuda":
        return "gloo"
    if cpu_offload and cuda_backend == "nccl":
        return "cuda:nccl,cpu:gloo"
    return cuda_backend


def init_distributed(requested_device: str, init_timeout_s: int, cpu_offload: bool = False) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); a lone process runs without one.
    ``cpu_offload``: a gloo CPU backend beside NCCL (parallel/cpu_offload.py)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if dist.is_initialized() and dist.get_backend() == "fake" and in_local_world():
        return DistContext(0, dist.get_world_size(), 0, device, LOCAL_BACKEND)  # --local-ranks: all in this process
    if world_size == 1:
        return DistContext(0, 1, 0, device, None)
    # MESHFORGE_CUDA_BACKEND=gloo: CUDA tensors over gloo, where NCCL refuses (several ranks on one GPU: the GPU check)
    backend = process_group_backend(device, os.environ.get("MESHFORGE_CUDA_BACKEND", "nccl"), cpu_offload)
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=init_timeout_s)
    )
    return DistContext(rank, world_size, local_rank, device, backend)


def in_local_world() -> bool:
    """Whether torch's local-tensor mode is on (``--local-ranks``, parallel/local_ranks.py)."""
    try:
        from torch.distributed._local_tensor import local_tensor_mode
    except ImportError:  # a torch without local tensors
        return False
    return local_tensor_mode() is not None


def set_timeouts(mesh: DeviceMesh | None, seconds: int) -> None:
    """Shorten every group's collective timeout after start-up: a rank that waits longer raises instead of hanging."""
    if not dist.is_initialized() or dist.get_backend() == "fake":  # --local-ranks: no traffic to time out
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = datetime.timedelta(seconds=seconds)
    groups = [None] if mesh is None else [None, *mesh.get_all_groups()]
    for group in groups:
        _set_pg_timeout(timeout, group)


def stop_key() -> str:
    """The key a rank that reported an error and ends the job sets in the job's store (to its exit code): the other
    ranks' hang watchdogs (observability/hang.py) see it within a second and leave with that code, without a message
    of their own, even while they wait in a collective for the rank that stopped. One per torchrun attempt: a restarted
    job must not see the dead attempt's."""
    return f"meshforge/stop/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def report_once(message: str, wait_s: float = 5.0, *, stop_code: int | None = None) -> None:
    """Print ``message`` to stderr on the first rank of the job that reports it (always without a process group): the
    ranks of a job that all hit the same error print it once. Counted in the process group's store (no collective).
    The first rank prints before anything else, since the launcher may kill it as soon as another rank exits; rank 0
    then waits up to ``wait_s`` for every rank's report, since its exit may take the store down. With ``stop_code``,
    ranks that did not meet the error (waiting for this one in a collective) are asked to leave with it (stop_key):
    they count themselves as reported, so rank 0's wait ends as soon as they are gone."""
    if not dist.is_initialized():
        print(message, file=sys.stderr, flush=True)
        return
    import hashlib
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    key = "meshforge/report/" + hashlib.sha1(message.encode()).hexdigest()
    try:
        store = _get_default_store()
        first = int(store.add(key, 1)) == 1
    except Exception:  # the store is gone (its host died): better twice than never
        print(message, file=sys.stderr, flush=True)
        return
    if first:
        print(message, file=sys.stderr, flush=True)
    try:
        if stop_code is not None:
            store.set(stop_key(), str(stop_code))
        reported = int(store.add("meshforge/reports", 1))
        deadline = time.monotonic() + wait_s
        while dist.get_rank() == 0 and reported < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.05)
            reported = int(store.add("meshforge/reports", 0))
    except Exception:  # the store is gone: nobody is left to wait for
        pass


def finish(ok: bool = True, code: int = 1) -> None:
    """End a distributed rank cleanly: flush, barrier, destroy the group, then ``os._exit`` (gloo can abort at
    interpreter exit when sub-groups exist; this path never does)."""
    if not dist.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0 if ok else code)


def clear_dtensor_caches() -> None:
    """Empty torch's DTensor sharding-propagation caches (Python and C++) and its redistribute-planner cache: forget
    the DeviceMeshes they hold after a temporary (fake) world ends.

    DTensor's sharding propagation caches its results (the Python ``lru_cache`` of ``ShardingPropagator`` and the C++
    fast-path cache) keyed by the input specs, and a ``DeviceMesh`` compares equal to another by its rank layout,
    device type, dimension names and thread alone: not by the rank it was built on nor by its process groups. A cached
    output spec carries the mesh object it was computed with. So after ``meshforge train --dry-run`` (rank 0 of a fake
    world), a later mesh of the same shape and names, in this process or in any process forked from it, gets the dry
    run's rank-0 mesh back in ops whose result the cache already holds (FSDP2's 1-D parameters, for one): on rank 1
    such a DTensor reports coordinate 0, and a distributed checkpoint of it saves rank 0's chunk twice ("invalid
    fill"). The redistribute planner cache is keyed by a weak reference to the mesh, which compares by the referent
    while it is alive: same hazard."""
    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
