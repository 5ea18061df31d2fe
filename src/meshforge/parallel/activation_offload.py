"""Activation offload: the tensors autograd saves for backward go to host memory at pack and come back when backward
unpacks them (our own ``torch.autograd.graph.saved_tensors_hooks``; torch's ``save_on_cpu`` copies on the compute
stream, a blocking ``copy_`` per saved tensor).

What goes: activations. Weights never do (``is_weight``: a parameter, a leaf that requires grad, or a view or cast of
one, such as the transposed or autocast-cast weight a matmul saves): the module holds them anyway (FSDP re-gathers
them for backward), so a copy would only spend the link and page-locked memory. Nor do wrapper subclasses other than
DTensor (Float8 tensors); a DTensor (TP / SP activations) moves its local shard and is rebuilt at unpack.

On CUDA (``StreamOffload``, the device's primitives in ``CudaStreams``): pack copies the tensor into a buffer of the
run's page-locked pool (parallel/offload_pool.py: exact sizes, reused every micro-step, bounded by the largest one)
on a side stream, non-blocking. The side stream first waits for the compute stream (the copy must see the tensor's
producer), the tensor is marked as used by the side stream (``record_stream``: the caching allocator does not hand
its memory to a later kernel before the copy is done), and an event marks the copy's end. Backward runs the blocks
in reverse: the first unpack of a block's tensors starts the copies back of the block before it (in forward order)
on a prefetch stream, each after its copy out's event, so they overlap this block's backward; an unpack makes the
compute stream wait for its tensor's prefetch event (device-side, no host synchronisation) and marks the prefetched
tensor as used by the compute stream (it was allocated on the prefetch stream's pool), or, not prefetched, waits for
the copy out and copies back on the compute stream. At the context's end the compute stream waits for the side and
prefetch streams and the pool takes its buffers back for the next micro-step. So the compute stream waits only at
unpack (or once when the pool grows), never at pack.

A write after pack: with the hooks autograd no longer checks that a saved tensor was not modified in place before
backward (it raises without them), and on CUDA such a write races the copy out (the copy may read either value).
Both paths therefore keep autograd's rule: the tensor's version is recorded at pack and an unpack whose tensor was
modified since raises (``check_version``). Writes that bypass the version counter (``.data``) are not seen; meshforge's
model code makes none.

On a CPU (``HostCopyOffload``): pack copies into a buffer of its own (``tensor.cpu()`` would return the tensor itself
and the hooks would prove nothing) and unpack returns that copy, so a wrong unpack changes the gradients
(tests/unit/test_activation_offload.py; the stream order: tests/unit/test_offload_streams.py, a CPU model of streams).

Composition: with activation checkpointing the offload applies to what the mode saves (the block inputs under full
AC, everything without AC). Under per-op selective AC the checkpoint's own hooks, pushed inside ours, take
precedence for everything saved in a checkpointed block: its cached op outputs stay on the device (the planner and
the memory run count them there). The memory run (tools/memory_run.py) models these hooks on fake tensors: a saved
tensor leaves the device at pack and is allocated again at unpack."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshforge.parallel.offload_pool import PinnedPool

VIEWS_AND_CASTS = frozenset(
    {
        "AliasBackward0", "ExpandBackward0", "PermuteBackward0", "ReshapeAliasBackward0", "SliceBackward0",
        "SplitBackward0", "SplitWithSizesBackward0", "SqueezeBackward0", "SqueezeBackward1", "TBackward0",
        "ToCopyBackward0", "TransposeBackward0", "UnsafeViewBackward0", "UnsqueezeBackward0", "ViewBackward0",
    }
)  # fmt: skip
"""Autograd nodes whose output is a view or a dtype cast of their one input: what lies between a parameter and the
weight a matmul saves (``weight.t()``, autocast's bf16 copy, a split of a fused weight)."""


def is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, a leaf that requires grad, or a view / cast of one (module docstring): never offloaded."""
    if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in VIEWS_AND_CASTS:
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        node = inputs[0] if len(inputs) == 1 else None
    return node is not None and type(node).__name__ == "AccumulateGrad"


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, DTensorSpec | None]:
    """The plain tensor to copy and, for a DTensor (TP / SP activations), the spec that rebuilds it at unpack."""
    if isinstance(tensor, DTensor):
        return tensor._local_tensor, tensor._spec
    return tensor, None


def _rebuild(local: torch.Tensor, spec: DTensorSpec | None) -> torch.Tensor:
    return local if spec is None else DTensor(local, spec, requires_grad=False)


def _offloadable(tensor: torch.Tensor) -> bool:
    """Activations: plain tensors and DTensors over plain tensors, not weights; other wrapper subclasses (Float8
    tensors) stay put."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return not is_traceable_wrapper_subclass(local) and not is_weight(tensor)


def check_version(source: weakref.ref[torch.Tensor], version: int) -> None:
    """Autograd's rule for saved tensors, which its hooks skip: no in-place write between pack and unpack."""
    tensor = source()
    if tensor is not None and tensor._version != version:
        raise RuntimeError(
            "activation offload: a tensor saved for backward was modified by an in-place operation after the forward "
            f"saved it (version {tensor._version}, saved at {version}): make that operation out of place"
        )


class HostCopyOffload(saved_tensors_hooks):
    """Saved tensors copied into separate host buffers (the CPU path; also what a non-CUDA device falls back to)."""

    def __init__(self) -> None:
        super().__init__(self.pack, self.unpack)

    @staticmethod
    def pack(tensor: torch.Tensor) -> Any:
        if not _offloadable(tensor):
            return tensor
        local, spec = _local(tensor)
        host = torch.empty_like(local, device="cpu")  # its strides kept (a dense view): backward's kernels unchanged
        host.copy_(local)
        return local.device, host, spec, weakref.ref(local), local._version

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, spec, source, version = packed
        check_version(source, version)
        return _rebuild(host if device.type == "cpu" else host.to(device), spec)


class CudaStreams:
    """The CUDA primitives ``StreamOffload`` orders its copies with (tests swap in a CPU model of streams that runs
    the other streams' work as late as the recorded order allows: tests/offload_stream_model.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def compute(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def wait_stream(self, waiter: Any, other: Any) -> None:
        waiter.wait_stream(other)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def copy_out(self, host: torch.Tensor, tensor: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)

    def copy_back(self, host: torch.Tensor, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return host.to(self.device, non_blocking=True)

    def synchronize(self, event: Any) -> None:
        event.synchronize()


@dataclass
class Saved:
    """One offloaded tensor: its device, pool buffer, copy-out event, DTensor spec, source (weak: for the version
    check), version at pack, block (forward order), pool generation; once prefetched, its device copy and event."""

    device: torch.device
    host: torch.Tensor
    done: Any
    spec: DTensorSpec | None
    source: weakref.ref[torch.Tensor]
    version: int
    block: int
    generation: int
    back: torch.Tensor | None = None
    arrived: Any = None


class StreamOffload(saved_tensors_hooks):
    """CUDA: copies out on a side stream into the run's pinned pool, copies back prefetched a block ahead on a
    prefetch stream (module docstring). ``blocks``: the transformer blocks whose forward starts a new group;
    ``streams``: the device's primitives (``CudaStreams``). The backward must run inside the context."""

    def __init__(
        self, device: torch.device, pool: PinnedPool, blocks: Iterable[nn.Module] = (), streams: Any = None
    ) -> None:
        super().__init__(self.pack, self.unpack)
        self.device, self.pool, self.blocks = device, pool, list(blocks)
        self.ops = streams if streams is not None else CudaStreams(device)
        self.side, self.prefetch = self.ops.stream(), self.ops.stream()
        self.block = 0
        self.by_block: dict[int, list[Saved]] = {}
        self.fetched: set[int] = set()
        self.hooks: list[Any] = []

    def __enter__(self) -> None:
        self.hooks = [block.register_forward_pre_hook(self._next_block) for block in self.blocks]
        super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self.hooks:
            hook.remove()
        compute = self.ops.compute()  # every copy of this context before the pool's buffers serve the next one
        self.ops.wait_stream(compute, self.side)
        self.ops.wait_stream(compute, self.prefetch)
        end = self.ops.record(compute)
        self.pool.reset(wait=lambda: self.ops.synchronize(end))
        self.by_block.clear()

    def _next_block(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.block += 1

    def pack(self, tensor: torch.Tensor) -> Any:
        local, spec = _local(tensor)
        if local.device.type != self.device.type or local.layout != torch.strided or not _offloadable(tensor):
            return tensor  # host tensors, weights, other subclasses stay
        nbytes = local.numel() * local.element_size()
        piece = self.pool.take(nbytes).view(local.dtype)
        # a dense view (a transposed activation) keeps its strides there and back: backward's kernels are unchanged
        strides = torch.empty_like(local, device="meta").stride()
        host = piece.as_strided(local.shape, strides) if strides == local.stride() else piece.view(local.shape)
        self.ops.wait_stream(self.side, self.ops.compute())  # the copy sees the tensor's producer
        self.ops.copy_out(host, local, self.side)
        self.ops.record_stream(local, self.side)  # its memory is not reused before the copy ends
        done = self.ops.record(self.side)
        saved = Saved(
            local.device, host, done, spec, weakref.ref(local), local._version, self.block, self.pool.generation
        )
        self.by_block.setdefault(self.block, []).append(saved)
        return saved

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        saved: Saved = packed
        if saved.generation != self.pool.generation:
            raise RuntimeError(
                "activation offload: a saved tensor unpacked after its context ended (run backward inside)"
            )
        check_version(saved.source, saved.version)
        self._prefetch(saved.block - 1)  # the block backward reaches next
        compute = self.ops.compute()
        if saved.back is not None:
            local, saved.back = saved.back, None
            self.ops.wait_event(compute, saved.arrived)
            self.ops.record_stream(local, compute)  # allocated on the prefetch stream, used and freed on compute
        else:
            self.ops.wait_event(compute, saved.done)
            local = self.ops.copy_back(saved.host, compute)
        return _rebuild(local, saved.spec)

    def _prefetch(self, block: int) -> None:
        """Copies back of ``block``'s saved tensors on the prefetch stream, each after its copy out (once)."""
        if block < 0 or block in self.fetched:
            return
        self.fetched.add(block)
        for saved in self.by_block.get(block, []):
            self.ops.wait_event(self.prefetch, saved.done)
            saved.back = self.ops.copy_back(saved.host, self.prefetch)
            saved.arrived = self.ops.record(self.prefetch)


POOLS: dict[torch.device, PinnedPool] = {}
"""One page-locked pool per device for the run (parallel/offload_pool.py)."""


def blocks_of(model_parts: Iterable[nn.Module]) -> list[nn.Module]:
    """The transformer blocks of the parts (``layers``), in forward order."""
    blocks: list[nn.Module] = []
    for part in model_parts:
        layers = getattr(part, "layers", None)
        blocks += list(layers.values()) if isinstance(layers, nn.ModuleDict) else []
    return blocks


def offload_context(
    enabled: bool, device: torch.device, model_parts: Iterable[nn.Module] = ()
) -> contextlib.AbstractContextManager[Any]:
    """Around forward and the backward it feeds: saved tensors to host memory when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    if device.type == "cuda":
        return StreamOffload(device, POOLS.setdefault(device, PinnedPool()), blocks_of(model_parts))
    return HostCopyOffload()
