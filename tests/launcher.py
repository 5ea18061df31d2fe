"""A forking launcher for CPU distributed tests: N gloo ranks as forked processes, a free port per call, one thread
per rank, a hard timeout, and a clean end on every rank (barrier, destroy, os._exit) so gloo never aborts at exit."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, queue: Any, args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from meshforge.parallel.distributed import clear_dtensor_caches

    clear_dtensor_caches()  # specs the parent cached hold its meshes (equal to this rank's, other coordinates)
    ok = True
    try:
        result: Any = ("ok", fn(*args))
    except BaseException as exc:  # report every failure to the parent, then end the process
        ok = False
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    import torch.distributed as dist

    if dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()
    os._exit(0 if ok else 1)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` forked ranks; returns each rank's result, raises on any failure."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, queue, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, result = queue.get(timeout=timeout)
            results[rank] = result
    except Exception as exc:
        raise TimeoutError(
            f"ranks {sorted(set(range(world_size)) - set(results))} gave no result in {timeout}s"
        ) from exc
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {res[1]}" for r, res in sorted(results.items()) if res[0] == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r][1] for r in range(world_size)]
