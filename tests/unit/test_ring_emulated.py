"""Ring attention at cp = 4 in one process: four threads play the cp ranks, their ring's sends go through in-memory
mailboxes (the real _RingAttentionFn, forward and backward, runs on each), and every rank's output and dQ/dK/dV equal
full causal attention's on its head-tail chunks. At cp = 2 a wrong source rank (r + s for r - s) is the same rank,
so only cp >= 3 can tell them apart; a gloo run at cp = 4 would take four processes and their start-up."""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch
import torch.nn.functional as F

from meshforge.parallel.context_parallel.ring import _RingAttentionFn


class MailboxRing:
    """Ring's interface (rank, size, shift) over per-(destination, tag) FIFO queues shared by the thread ranks."""

    def __init__(self, rank: int, size: int, boxes: dict[tuple[int, int], queue.Queue[torch.Tensor]]) -> None:
        self.rank, self.size, self.boxes = rank, size, boxes

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[list[Any], torch.Tensor]:
        self.boxes[(self.rank + 1) % self.size, tag].put(tensor.detach().clone())
        recv = torch.empty_like(tensor)
        return [Receive(self.boxes[self.rank, tag], recv)], recv


ABORT = threading.Event()  # a rank failed: the others stop waiting for its messages


class Receive:
    def __init__(self, box: queue.Queue[torch.Tensor], into: torch.Tensor) -> None:
        self.box, self.into = box, into

    def wait(self) -> None:
        for _ in range(600):  # 60 s
            try:
                self.into.copy_(self.box.get(timeout=0.1))
                return
            except queue.Empty:
                if ABORT.is_set():
                    raise RuntimeError("another rank failed") from None
        raise TimeoutError("no message from the previous rank in 60 s")


def head_tail(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim=2)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=2)


def test_ring_backward_at_cp4_matches_full_attention() -> None:
    cp, gen = 4, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * cp, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, 2, 8 * cp, 8, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]  # the reference in float64, the ring in float32
    reference = F.scaled_dot_product_attention(*full, is_causal=True)
    reference.backward(dout)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    boxes: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {(r, t): queue.Queue() for r in range(cp) for t in (0, 1)}
    results: dict[int, Any] = {}
    ABORT.clear()

    def rank_main(rank: int) -> None:
        try:
            local = [head_tail(t, rank, cp).requires_grad_() for t in (q, k, v)]
            out = _RingAttentionFn.apply(*local, MailboxRing(rank, cp, boxes))
            out.backward(head_tail(dout, rank, cp))
            results[rank] = (out.detach(), *(t.grad for t in local))
        except BaseException as exc:  # reported below
            results[rank] = exc
            ABORT.set()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    errors = {r: repr(res) for r, res in results.items() if isinstance(res, BaseException)}
    assert len(results) == cp, f"cp ranks {sorted(set(range(cp)) - set(results))} hung"
    assert not errors, f"ring attention failed at cp = 4 (a K/V block paired with the wrong source rank?): {errors}"
    names = ("output", "dQ", "dK", "dV")
    expected = (reference.detach(), *(t.grad for t in full))
    for rank in range(cp):
        for name, got, want in zip(names, results[rank], expected, strict=True):
            err = float((got - head_tail(want, rank, cp)).abs().max())
            # float32 ring vs the float64 reference: 4.2e-7 at most measured, 10x margin
            assert err < 5e-6, f"cp rank {rank}: ring attention {name} differs from full attention by {err:.2e}"
