"""A CPU model of CUDA streams for activation offload's ``StreamOffload`` (its ``streams`` argument, in place of
``CudaStreams``): the stream order a GPU would follow, checked on a CPU.

The Python program is the compute stream: its work runs at once. Every other stream queues its work and runs it as
late as the recorded order allows, which is what a GPU may do: only when the compute stream waits for it (an event or
the whole stream), when the host synchronises on it, or at ``finish``; streams named in ``early`` instead run each
piece of work as soon as it is queued (after the waits queued before it), which is what a GPU may do too. A race
between a reader and a writer on two streams shows when the reader runs early and the writer late, so the checks run
under both schedules (``SCHEDULES``). A missing wait shows:

- a copy back (on the compute stream, or early on the prefetch stream) that does not wait for its copy out reads the
  host buffer before the copy wrote it: the pool's slabs are filled with 0xFF (NaN in every float dtype), so the
  gradients turn NaN;
- the compute stream using a prefetched tensor without waiting for its event reads a NaN-filled tensor;
- a copy out of a tensor whose memory was not marked as used by the side stream (``record_stream``) runs after the
  program dropped the tensor, i.e. after the caching allocator could have handed the memory on: ``UseAfterFree``;
- a write on the compute stream after pack reaches the copy out, as on a GPU (the version check must catch it).

It logs each copy with its stream, and counts the slabs page-locked and released.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class UseAfterFree(AssertionError):
    """A queued copy read a tensor the program had dropped without ``record_stream`` on the copy's stream."""


SCHEDULES = {"late": (), "prefetch_early": ("stream1",)}
"""Every other stream late; or the prefetch stream (StreamOffload's second) early and the side stream late."""


class ModelStreams:
    COMPUTE = "compute"

    def __init__(self, early: tuple[str, ...] = ()) -> None:
        self.early = early
        self.queues: dict[str, list[Callable[[], None]]] = {}
        self.ran: dict[str, int] = {}
        self.kept: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.log: list[tuple[str, str]] = []
        self.pinned = 0
        self.unpinned = 0

    # the streams and their order
    def compute(self) -> str:
        return self.COMPUTE

    def stream(self) -> str:
        name = f"stream{len(self.queues)}"
        self.queues[name], self.ran[name], self.kept[name] = [], 0, []
        return name

    def run(self, stream: str, upto: int | None = None) -> None:
        """Run ``stream``'s queued work up to item ``upto`` (all by default), in order."""
        if stream == self.COMPUTE:
            return
        queue = self.queues[stream]
        end = len(queue) if upto is None else upto
        while self.ran[stream] < end:
            self.ran[stream] += 1
            queue[self.ran[stream] - 1]()
        self.kept[stream] = [(i, t) for i, t in self.kept[stream] if i > self.ran[stream]]

    def enqueue(self, stream: str, work: Callable[[], None]) -> None:
        if stream == self.COMPUTE:
            work()
        else:
            self.queues[stream].append(work)
            if stream in self.early:
                self.run(stream)

    def wait_stream(self, waiter: str, other: str) -> None:
        upto = len(self.queues[other]) if other != self.COMPUTE else 0
        self.enqueue(waiter, lambda: self.run(other, upto))

    def record(self, stream: str) -> tuple[str, int]:
        return stream, len(self.queues[stream]) if stream != self.COMPUTE else 0

    def wait_event(self, stream: str, event: tuple[str, int]) -> None:
        self.enqueue(stream, lambda: self.run(*event))

    def synchronize(self, event: tuple[str, int]) -> None:
        self.run(*event)

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        if stream != self.COMPUTE:  # the allocator keeps the memory until the stream's work so far has run
            self.kept[stream].append((len(self.queues[stream]), tensor))

    # the copies
    def copy_out(self, host: torch.Tensor, tensor: torch.Tensor, stream: str) -> None:
        source = weakref.ref(tensor)
        self.log.append(("copy_out", stream))

        def work() -> None:
            live = source()
            if live is None:
                raise UseAfterFree("a copy out ran after its tensor was freed (no record_stream on its stream)")
            host.copy_(live)

        self.enqueue(stream, work)

    def copy_back(self, host: torch.Tensor, stream: str) -> torch.Tensor:
        self.log.append(("copy_back", "compute" if stream == self.COMPUTE else "prefetch"))
        out = torch.full_like(host, float("nan")) if host.is_floating_point() else torch.empty_like(host)
        self.enqueue(stream, lambda: out.copy_(host))
        return out

    def finish(self) -> None:
        for stream in self.queues:
            self.run(stream)

    # page-locked memory (parallel/offload_pool.py's pin / unpin)
    def pin(self, nbytes: int) -> torch.Tensor:
        self.pinned += 1
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8)

    def unpin(self, slab: torch.Tensor) -> None:
        self.unpinned += 1


def copies(log: list[tuple[str, str]], kind: str) -> dict[str, int]:
    """{stream: count} of one kind of copy in a ``ModelStreams.log``."""
    out: dict[str, int] = {}
    for what, stream in log:
        if what == kind:
            out[stream] = out.get(stream, 0) + 1
    return out


__all__ = ["Any", "ModelStreams", "UseAfterFree", "copies"]
