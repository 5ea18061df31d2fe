"""Page-locked host memory for activation offload (parallel/activation_offload.py): one pool per device, reused by
every micro-step, bounded by the largest micro-step's saved bytes.

torch's pinned allocations (``pin_memory=True``) go through its caching host allocator, which rounds every request up
to a power of two and keeps each block for the process's life: up to 2x the saved bytes page-locked per rank, never
returned. Here: slabs of plain host memory page-locked exactly (``cudaHostRegister`` of their own bytes, as DCP's
staging does), handed out in order (``take``: a bump pointer per slab, ``ALIGN`` bytes aligned) and all taken back
at the end of the offload context (``reset``, after the backward that read them). A micro-step that needs more than
the slabs hold gets an overflow slab (at least ``GROW_BYTES``); at its end the pool waits once for the device (the
copies must be done before memory is unregistered: one host synchronisation, only when the pool grew) and replaces
its slabs by one slab of exactly what the micro-step took, which the next micro-steps of the same shape reuse
without a new registration.

Reuse is ordered on the device, not on the host: the next micro-step's device-to-host copies run on the offload's
side stream after it waited for the compute stream, and the context's exit made the compute stream wait for the side
and prefetch streams (every read of the buffers: the copies back) first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ALIGN = 512
"""Bytes each buffer's start is aligned to (DMA-friendly; the waste is < ALIGN per saved tensor)."""
GROW_BYTES = 64 * 2**20
"""The least an overflow slab page-locks (fewer registrations while the first micro-step finds its size)."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def register_host(slab: torch.Tensor) -> None:
    """Page-lock ``slab``'s own bytes (``cudaHostRegister``, portable: as torch's own staging does)."""
    error = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 1))
    if error:
        raise RuntimeError(f"activation offload: page-locking {slab.numel()} bytes failed (cudaError {error})")


def unregister_host(slab: torch.Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(slab.data_ptr()))
    if error:
        raise RuntimeError(f"activation offload: releasing a page-locked buffer failed (cudaError {error})")


def pin_host(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked exactly (no power-of-two rounding, no caching allocator)."""
    slab = torch.empty(nbytes, dtype=torch.uint8)
    register_host(slab)
    return slab


def unpin_host(slab: torch.Tensor) -> None:
    unregister_host(slab)


class PinnedPool:
    """Host buffers for saved tensors, taken during a micro-step and all given back by ``reset`` (module docstring).
    ``pin`` / ``unpin``: page-lock and release a slab (CUDA: ``pin_host`` / ``unpin_host``; tests: a CPU model)."""

    def __init__(
        self, pin: Callable[[int], torch.Tensor] = pin_host, unpin: Callable[[torch.Tensor], None] = unpin_host
    ) -> None:
        self.pin, self.unpin = pin, unpin
        self.slabs: list[torch.Tensor] = []
        self.used: list[int] = []
        self.registrations = 0
        """Slabs page-locked over the pool's life (a micro-step of a known shape adds none)."""
        self.grew = False
        """A slab was added since the last ``reset``."""
        self.generation = 0
        """Incremented by every ``reset``: a buffer taken before belongs to an ended context."""

    @property
    def pinned_bytes(self) -> int:
        return sum(slab.numel() for slab in self.slabs)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes``, page-locked, the pool's until ``reset``."""
        size = aligned(nbytes)
        for i, slab in enumerate(self.slabs):
            if self.used[i] + size <= slab.numel():
                start = self.used[i]
                self.used[i] += size
                return slab[start : start + nbytes]
        self._add(max(size, GROW_BYTES))
        self.used[-1] = size
        return self.slabs[-1][:nbytes]

    def reset(self, wait: Callable[[], None]) -> None:
        """Every buffer back (the device's reads of them are ordered before the next writes: module docstring). When
        the micro-step added a slab, ``wait`` for the device once and keep one slab of exactly what it took."""
        if self.grew:
            total = sum(self.used)
            wait()
            self.release()
            if total:
                self._add(total)
        self.used = [0] * len(self.slabs)
        self.grew = False
        self.generation += 1

    def release(self) -> None:
        """Unregister and drop every slab (the device must be done with them)."""
        for slab in self.slabs:
            self.unpin(slab)
        self.slabs, self.used = [], []

    def _add(self, nbytes: int) -> None:
        self.slabs.append(self.pin(nbytes))
        self.used.append(0)
        self.registrations += 1
        self.grew = True
