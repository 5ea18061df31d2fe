"""The fake-CUDA environment of scripts/fake_cuda_check.py: torch.cuda's driver queries, streams and events stubbed,
real tensors where the work is the host's, a stand-in for ``to_empty`` where fake parameters cannot be swapped, and
the meta-outer wrapper (``MetaOuter``) under which the autograd engine runs backward without a driver."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist


class MetaOuter(torch.Tensor):
    """A wrapper whose outer tensor is on ``meta`` around a fake CUDA tensor: ops run on the inner tensor (the guard
    sees CUDA), the autograd engine sees meta tensors (no driver query), so backward and the optimizer can run."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> MetaOuter:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device="meta",
            requires_grad=inner.requires_grad,
        )  # fmt: skip

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    def tolist(self) -> Any:  # not dispatched for subclasses: the inner tensor's (a host read the guard counts)
        return self.inner.tolist()

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> MetaOuter:
        return MetaOuter(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        unwrap = lambda t: t.inner if isinstance(t, MetaOuter) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: MetaOuter(t) if type(t) is not MetaOuter and isinstance(t, torch.Tensor) else t, out)


def fake_materialize(original: Any) -> Any:
    """``materialize``, and where ``to_empty`` cannot swap a fake parameter in place (a model without FSDP: "Couldn't
    swap Embedding.weight", the parameter being tied), new Parameters on the device instead, ties kept."""

    def run(model: torch.nn.Module, device: torch.device, *, cpu_offload: bool) -> None:
        try:
            original(model, device, cpu_offload=cpu_offload)
            return
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
        new: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    if id(p) not in new:
                        new[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                    module._parameters[name] = new[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty_like(b, device=device)

    return run


class _InnerSDPA(torch.autograd.Function):
    """Causal attention of MetaOuter q, k, v with the CUDA kernel's own forward and backward ops on the inner fake
    tensors (sdpa on the meta outer would pick the math path, whose masks are plain meta tensors)."""

    @staticmethod
    def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
        op = torch.ops.aten._scaled_dot_product_efficient_attention.default
        out, lse, seed, offset = op(q.inner, k.inner, v.inner, None, True, 0.0, True)
        ctx.save_for_backward(q, k, v)
        ctx.saved = (out, lse, seed, offset)
        return MetaOuter(out)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        q, k, v = ctx.saved_tensors
        out, lse, seed, offset = ctx.saved
        op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
        g = grad.inner if isinstance(grad, MetaOuter) else grad
        dq, dk, dv, _ = op(g, q.inner, k.inner, v.inner, None, out, lse, seed, offset, 0.0, [True, True, True, False],
                           True)  # fmt: skip
        return MetaOuter(dq), MetaOuter(dk), MetaOuter(dv)


def meta_outer_sdpa(original: Any) -> Any:
    def run(q: Any, k: Any, v: Any, *args: Any, enable_gqa: bool = False, **kwargs: Any) -> Any:
        if not isinstance(q, MetaOuter) or args or kwargs.get("attn_mask") is not None:
            return original(q, k, v, *args, enable_gqa=enable_gqa, **kwargs)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _InnerSDPA.apply(q, k, v)

    return run


def wrapped_parts(build: Any) -> Any:
    """``build_model_parts`` whose parameters and buffers are MetaOuter wrappers (after initialisation)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        parts, pipeline = build(*args, **kwargs)
        for part in parts:
            for module in part.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[name] = torch.nn.Parameter(MetaOuter(p.data), p.requires_grad)
                for name, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[name] = MetaOuter(b)
        return parts, pipeline

    return run


STREAM_OPS: dict[str, int] = {}
"""Calls on the stubbed streams (a side stream's wait for the compute stream, the compute stream's wait for an
event), reset per layout."""


class FakeCudaStream(torch.Stream):
    """A stream object torch's argument parser accepts (``record_stream``), counting the waits it is asked for."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FakeCudaStream:
        return super().__new__(cls, device="cpu")

    def wait_stream(self, stream: Any) -> None:
        STREAM_OPS["wait_stream"] = STREAM_OPS.get("wait_stream", 0) + 1

    def wait_event(self, event: Any) -> None:
        STREAM_OPS["wait_event"] = STREAM_OPS.get("wait_event", 0) + 1

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else FakeCudaEvent()

    def synchronize(self) -> None:
        STREAM_OPS["stream_synchronize"] = STREAM_OPS.get("stream_synchronize", 0) + 1

    def query(self) -> bool:
        return True

    def __enter__(self) -> FakeCudaStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class FakeCudaEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        STREAM_OPS["event_synchronize"] = STREAM_OPS.get("event_synchronize", 0) + 1

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: Any) -> float:
        return 1.0


@contextlib.contextmanager
def cuda_stubs() -> Iterator[None]:
    """The device queries a driver would answer (what FSDP2, metrics and the peak table ask)."""
    patches = {
        "current_device": lambda: 0, "device_count": lambda: 1, "set_device": lambda *a: None,
        "synchronize": lambda *a, **k: None, "get_device_name": lambda *a: "NVIDIA H200",
        "get_device_capability": lambda *a: (9, 0), "max_memory_reserved": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0, "reset_peak_memory_stats": lambda *a, **k: None,
        "Event": FakeCudaEvent, "current_stream": lambda *a: FakeCudaStream(), "Stream": FakeCudaStream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "get_rng_state": lambda *a: torch.zeros(16, dtype=torch.uint8),
    }  # fmt: skip
    from meshforge.parallel import offload_pool

    def count(name: str) -> Any:
        return lambda *a, **k: STREAM_OPS.__setitem__(name, STREAM_OPS.get(name, 0) + 1)

    with contextlib.ExitStack() as stack:
        # page-locking needs the driver (cudaHostRegister): counted instead (activation offload's pool)
        stack.enter_context(mock.patch.object(offload_pool, "register_host", count("host_register")))
        stack.enter_context(mock.patch.object(offload_pool, "unregister_host", count("host_unregister")))
        # the fake backend says it takes cpu and cuda; as NCCL it takes cuda only (collectives pick devices by it)
        stack.enter_context(mock.patch.dict(dist.Backend.backend_capability, {"fake": ["cuda"]}))
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        yield


def unfaked(fn: Any) -> Any:
    """``fn`` run with real tensors (a mesh's rank table, the data loader's host batches are not device work)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def real_tensors_for(loop: Any) -> Iterator[None]:
    from meshforge.parallel.dims import ParallelDims

    with contextlib.ExitStack() as stack:
        for name in ("build_mesh", "build_expert_mesh"):
            stack.enter_context(mock.patch.object(ParallelDims, name, unfaked(getattr(ParallelDims, name))))
        import meshforge.checkpoint.dcp as dcp
        import meshforge.model.llama as llama

        # the checkpointer's own gloo group: on the fake store a real gloo group cannot connect; a fake one stands in
        new_group = dist.new_group
        fake_group = lambda *a, backend=None, **k: new_group(*a, **k)  # noqa: E731
        stack.enter_context(mock.patch.object(dcp.dist, "new_group", fake_group))

        host_init = unfaked(llama.initial_value)  # a CUDA generator needs the driver: draw on the host, then move
        stack.enter_context(
            mock.patch.object(
                llama, "initial_value", lambda f, s, a, seed, d: host_init(f, s, a, seed, torch.device("cpu")).to(d)
            )
        )
        for name in ("build_dataloader", "build_validation_loader", "build_tokenizer"):
            stack.enter_context(mock.patch.object(loop, name, unfaked(getattr(loop, name))))
        import meshforge.parallel.cpu_offload as cpu_offload
        import meshforge.parallel.pipeline.stage as stage

        for module in (loop, cpu_offload, stage):
            if hasattr(module, "materialize"):
                stand_in = fake_materialize(cpu_offload.materialize)
                stack.enter_context(mock.patch.object(module, "materialize", stand_in))
        yield


@contextlib.contextmanager
def meta_outer(loop: Any) -> Iterator[None]:
    """The model's parameters and buffers as MetaOuter wrappers, attention through the CUDA kernel's own ops, and
    fused AdamW told that the outer device (meta) is supported."""
    import torch.optim.optimizer as optimizer

    sdpa = torch.nn.functional.scaled_dot_product_attention
    fused = optimizer._get_fused_kernels_supported_devices
    with (
        mock.patch.object(loop, "build_model_parts", wrapped_parts(loop.build_model_parts)),
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", meta_outer_sdpa(sdpa)),
        mock.patch.object(optimizer, "_get_fused_kernels_supported_devices", lambda: [*fused(), "meta"]),
    ):
        yield
