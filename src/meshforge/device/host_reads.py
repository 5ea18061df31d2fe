"""Count the device-to-host reads of a piece of code, with their call sites: the check that a training step which does
not log never makes the host wait for the device.

A read is anything that needs a tensor's value on the host: ``.item()``, ``float()`` / ``int()`` / ``bool()`` of a
tensor, an ``if tensor:``, a format of a tensor (all go through ``aten._local_scalar_dense``), ``.tolist()``,
``.numpy()``, ``.cpu()``, ``.to("cpu")`` with the host as a string (seen at the Python level: on a CPU ``.tolist()``
and ``.numpy()`` never reach the dispatcher), a copy from an accelerator into a host tensor (``copy_`` /
``_to_copy``), and ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``). The ops are the same whatever the device, so on a CPU every such call
is recorded: what reads a host tensor on a CPU reads a device tensor on CUDA unless the tensor was made on the host on
purpose, which the call site tells. Not seen on a CPU: a copy between the device and host memory (both ends are the
host here) and reads made inside a C++ kernel without the dispatcher (a boolean-mask index).

Each read records its op and the call site: the innermost frame inside meshforge (the line to fix or to justify) and,
when the read happens deeper (inside torch or torchft), the innermost frame outside this file (the library's line).

    with HostReads() as reads:
        train_step(state)
    assert not reads.reads, reads.report()
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(os.path.dirname(_HERE)) + os.sep  # .../meshforge/
_MACHINERY = ("overrides.py", "_python_dispatch.py", "eval_frame.py", os.path.join("torch", "_compile.py"))
_SCALAR = {torch.ops.aten._local_scalar_dense.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_METHODS = {"tolist", "numpy", "cpu"}
# ops whose output size depends on tensor values: on CUDA the host waits for the device to learn it (a CPU kernel reads
# the values directly, without _local_scalar_dense)
_SHAPE_FROM_DATA = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.unique_dim.default,
}


@dataclass(frozen=True)
class HostRead:
    """One device-to-host read: the op, meshforge's line that caused it, and the library line that made it."""

    op: str
    site: str
    origin: str

    def __str__(self) -> str:
        via = f" (inside {self.origin})" if self.origin and self.origin != self.site else ""
        return f"{self.op} at {self.site}{via}"


def _where(frame: FrameType | None) -> tuple[str, str]:
    """(innermost meshforge frame, innermost frame outside this file and torch's mode machinery) as file:line fn."""
    site = origin = ""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.endswith(_MACHINERY):
            text = f"{_short(path)}:{frame.f_lineno} {frame.f_code.co_name}"
            origin = origin or text
            if path.startswith(_PACKAGE):
                site = text
                break
        frame = frame.f_back
    return site or "(outside meshforge)", origin


def _short(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "src" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _host_device(value: Any) -> bool:
    return value is not None and torch.device(value).type == "cpu"


@dataclass
class HostReads:
    """A context manager recording every device-to-host read made while it is active (all threads' calls from the
    thread that entered it: autograd's backward included, as torch runs it on the calling thread on a CPU)."""

    reads: list[HostRead] = field(default_factory=list)
    _modes: list[Any] = field(default_factory=list)

    def record(self, op: str) -> None:
        site, origin = _where(sys._getframe(1))
        self.reads.append(HostRead(op, site, origin))

    def __enter__(self) -> HostReads:
        self._modes = [_FunctionReads(self), _DispatchReads(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def report(self) -> str:
        """One line per distinct read, with its count."""
        counts: dict[str, int] = {}
        for read in self.reads:
            counts[str(read)] = counts.get(str(read), 0) + 1
        return "\n".join(f"{n} x {what}" for what, n in counts.items()) or "no host reads"


class _DispatchReads(TorchDispatchMode):
    """``_local_scalar_dense`` (item / float / int / bool / format) and copies from an accelerator to the host."""

    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SCALAR:
            self.owner.record(str(func.overloadpacket.__name__))
        elif func in _SHAPE_FROM_DATA or _repeat_interleave_sized_by_data(func, kwargs):
            self.owner.record(f"{func.overloadpacket.__name__} (output size from the data)")
        elif func in _COPIES and _is_download(func, args, kwargs):
            self.owner.record(f"{func.overloadpacket.__name__} to the host")
        return func(*args, **kwargs)


def _repeat_interleave_sized_by_data(func: Any, kwargs: dict[str, Any]) -> bool:
    """``repeat_interleave`` with tensor repeats and no ``output_size``: CUDA reads the repeats' sum on the host."""
    return func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None


def _is_download(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A copy whose source is on an accelerator and whose result lands on the host (never true on a CPU)."""
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    src = args[0]
    return src.device.type != "cpu" and _host_device(kwargs.get("device"))


class _FunctionReads(TorchFunctionMode):
    """``.tolist()``, ``.numpy()``, ``.cpu()`` and ``.to(<host>)``: host reads that bypass the dispatcher on a CPU."""

    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _METHODS or (name == "to" and _to_host(args, kwargs)):
            self.owner.record(f"Tensor.{name}()")
        return func(*args, **kwargs)


def _to_host(args: Any, kwargs: dict[str, Any]) -> bool:
    """``tensor.to("cpu")``: the host named as a string. A ``torch.device`` (or a tensor's device) is the compute
    device on CUDA as on a CPU run, where it cannot be told apart from the host; a dtype-only ``.to`` is no read."""
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, str):
            target = a
    return isinstance(target, str) and _host_device(target)
