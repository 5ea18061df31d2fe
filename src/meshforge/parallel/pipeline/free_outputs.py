"""A pipeline stage that holds only what its schedule still needs (issue 44, item 2).

torch's ``PipelineStage`` (2.13) keeps, per stage and microbatch:
- **the forward output** in ``fwd_cache`` from the forward until that microbatch's backward. A non-last stage needs
  its data only for the send to the next stage; backward needs the output's autograd node and shape, not its values
  (the block ends in the residual add, whose backward saves nothing). Megatron's ``deallocate_output_tensor`` frees it
  after the send; :func:`release_output` does the same, keeping the shape.
- **one activation and one gradient receive buffer for every microbatch of the step**, allocated once and kept for the
  whole run (``_setup_forward_recv_info`` / ``_setup_backward_recv_info``), m x 2 x the stage boundary per stage. Here
  a buffer has storage only from its receive until the microbatch's last backward action (B, or W after I): the
  activation is the stage's input, which the first block's RMSNorm saves for backward (model/lean.py), so it must stay
  until then; the gradient is read by backward (and, on a first stage with a split backward, by W).

Freeing the output after the send: the send's tensor is a detached alias of the output's storage, so the output is
pointed at a one-element placeholder (expanded to its shape) and the old storage lives exactly as long as the send
holds it (the backend keeps the send's tensor until the op completes: NCCL by recordStream or its stash, gloo until
the work is dropped). Nothing is resized in place while a send may still read it. An output whose storage anything
else shares (a view, its base, a copy autograd saved, e.g. an ``exp`` output) is left alone: :func:`release_output`
counts the storage's users.
V-schedules pass tensors between a rank's adjacent stages without a send: the receive slot holds an alias of the
previous stage's output (the next stage's input, saved by its norm) or of the next stage's input gradient, which torch
keeps until the next step's pass; here the slot gets a placeholder after the microbatch's last backward action.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshforge.parallel.pipeline.bubble import TimedPipelineStage


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the storage (a DTensor's local shard)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (views, detached aliases, copies autograd saved; not ``t``'s own)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 2  # minus t's own reference and this Python handle


def release_output(out: torch.Tensor, aliases: int) -> int:
    """Point a sent stage output at a one-element placeholder of the same shape; its old storage is freed when the
    ``aliases`` sends that hold it let go. Returns the bytes released: 0, changing nothing, when anything else shares
    the storage (a view, its base, a copy autograd saved), which would keep it alive anyway. Not detectable here: an op
    of the stage that consumed the output and saved that very tensor; a stage's output is its last block's residual
    add, which nothing after it in the stage reads."""
    local = local_of(out)
    if local._base is not None or local.numel() <= 1 or storage_users(local) != aliases:
        return 0
    nbytes = local.untyped_storage().nbytes()
    local.data = torch.empty((), dtype=local.dtype, device=local.device).expand(local.shape)
    return nbytes


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes the storage of ``t`` needs to hold every element ``t`` addresses."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return int((t.storage_offset() + extent) * t.element_size())


def release_buffer(t: torch.Tensor) -> int:
    """Free a receive buffer's storage (its shape stays); returns the bytes freed."""
    storage = local_of(t).untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    return nbytes


def restore_buffer(t: torch.Tensor) -> None:
    """Give a released receive buffer its storage back before a receive writes into it."""
    local = local_of(t)
    need = storage_bytes(local)
    if local.untyped_storage().nbytes() < need:
        local.untyped_storage().resize_(need)


def _buffers(infos: Any) -> list[torch.Tensor]:
    """The receive buffers of one microbatch's ``_RecvInfo`` tuple (first stages have none)."""
    return [info.buffer for info in infos if getattr(info, "buffer", None) is not None]


class LeanPipelineStage(TimedPipelineStage):
    """A timed ``PipelineStage`` that frees sent outputs and keeps receive buffers only while in use (module doc).
    ``released_bytes`` counts what was freed (tests and the memory tools read it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released_bytes = 0
        self._in_use: dict[int, list[torch.Tensor]] = {}  # microbatch -> buffers its receives filled
        self._local: dict[int, list[Any]] = {}  # microbatch -> receive slots a same-rank stage filled (V-schedules)

    def _setup_forward_recv_info(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_forward_recv_info(*args, **kwargs)  # type: ignore[misc]
        for infos in self.args_recv_info.values():
            for buffer in _buffers(infos):
                release_buffer(buffer)

    def _setup_backward_recv_info(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_backward_recv_info(*args, **kwargs)  # type: ignore[misc]
        for infos in self.grad_recv_info.values():
            for buffer in _buffers(infos):
                release_buffer(buffer)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._receive_into(self.args_recv_info[fwd_chunk_id], fwd_chunk_id, super().get_fwd_recv_ops)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_last:
            return []
        return self._receive_into(self.grad_recv_info[bwd_chunk_id], bwd_chunk_id, super().get_bwd_recv_ops)

    def _receive_into(self, infos: Any, chunk: int, ops: Any) -> list[dist.P2POp]:
        buffers = _buffers(infos)
        for buffer in buffers:
            restore_buffer(buffer)
        self._in_use.setdefault(chunk, []).extend(buffers)
        result: list[dist.P2POp] = ops(chunk)
        return result

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        """V-schedules pass a rank's stage output to its next stage without a send: the slot holds an alias of it."""
        super().set_local_fwd_input(prev_stage_outputs, mb_index)
        self._local.setdefault(mb_index, []).extend(self.args_recv_info[mb_index])

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        """The same for gradients; torch zeroes the slot's buffer for a missing one."""
        for buffer in _buffers(self.grad_recv_info[mb_index]):
            restore_buffer(buffer)
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)
        self._local.setdefault(mb_index, []).extend(self.grad_recv_info[mb_index])

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        for out in outputs:
            if isinstance(out, torch.Tensor):
                storage = local_of(out).untyped_storage().data_ptr()
                aliases = sum(op.tensor.untyped_storage().data_ptr() == storage for op in ops)
                self.released_bytes += release_output(out, aliases) if aliases else 0
        return ops

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not (self.has_backward and torch.is_grad_enabled()):  # evaluation: nothing saved the input
            self._done(fwd_chunk_id)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> None:
        super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)
        if full_backward:
            self._done(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._done(bwd_chunk_id)

    def _done(self, chunk: int) -> None:
        """The microbatch's last action ran: free the buffers its receives filled (and a split backward's input
        gradient, which torch leaves on the buffer until the next step; it was sent already)."""
        for buffer in self._in_use.pop(chunk, []):
            buffer.grad = None
            self.released_bytes += release_buffer(buffer)
        for info in self._local.pop(chunk, []):  # torch would keep the alias until the next step's pass
            if getattr(info, "buffer", None) is not None:
                info.buffer = torch.empty((), dtype=info.buffer.dtype, device=info.buffer.device).expand(
                    info.buffer.shape
                )
