"""Count the collectives a piece of code issues: calls and bytes per (collective, mesh axis), for proofs such as "one
gradient exchange per optimizer step" and for the step-at-scale figures (docs/benchmarks/step-at-scale.md).

Two entry points cover what meshforge runs: the ``torch.distributed`` functions FSDP2, the pipeline schedules, the
loss mean and the metrics call, and the functional collectives DTensor and expert parallel call
(``torch.distributed._functional_collectives``): both patched on their module for the counter's lifetime (callers
look them up there at call time; a dispatch mode would not see DTensor's, issued inside its own dispatch). Bytes are
the input tensor's (the reduce-scatter's full input, the all-gather's local shard, the all-reduce's buffer): what one
rank hands to the collective. A group is named by the mesh axis it belongs to (``axis_names``), else ``other``.

    with CollectiveCounter(axis_names(mesh, FLATTENED)) as counts:
        train_step(state)
    counts.table()  # {("reduce_scatter", "dp_shard"): (calls, bytes), ...}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# torch.distributed function -> (collective, index of the tensor whose bytes count, keyword of it, index of the group)
_FUNCTIONS: dict[str, tuple[str, int, str, int]] = {
    "all_reduce": ("all_reduce", 0, "tensor", 2),
    "reduce_scatter_single": ("reduce_scatter", 1, "input", 3),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3),
    "all_gather_single": ("all_gather", 1, "input_tensor", 2),
    "all_gather_into_tensor": ("all_gather", 1, "input_tensor", 2),
    "all_to_all_single": ("all_to_all", 1, "input", 4),
    "broadcast": ("broadcast", 0, "tensor", 2),
    "send": ("send", 0, "tensor", 2),
}  # not isend / irecv: torch's P2POp (the pipeline schedules' batched sends) accepts only the original functions
# torch.distributed._functional_collectives (DTensor's redistributions, expert parallel's all-to-all) -> (collective,
# index of the group argument)
_FUNCTIONAL: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "reduce_scatter_single": ("reduce_scatter", 3),
    "reduce_scatter_single_autograd": ("reduce_scatter", 3),
    "all_gather_tensor": ("all_gather", 2),
    "all_gather_single": ("all_gather", 2),
    "all_gather_single_autograd": ("all_gather", 2),
    "all_to_all_single": ("all_to_all", 3),
    "all_to_all_single_autograd": ("all_to_all", 3),
    "broadcast": ("broadcast", 2),
}


def axis_names(mesh: DeviceMesh | None, flattened: Iterable[str] = ()) -> dict[str, str]:
    """Process-group name -> mesh axis, for the mesh's own dims and the ``flattened`` ones built on it (meshforge's:
    parallel/dims.py FLATTENED)."""
    if mesh is None:
        return {}
    names: dict[str, str] = {}
    for axis in [*(mesh.mesh_dim_names or ()), *flattened]:
        try:
            sub = mesh[axis]
        except (KeyError, RuntimeError, ValueError):  # a flattened axis this layout did not build
            continue
        if sub.ndim == 1:
            names.setdefault(sub.get_group().group_name, axis)
    return names


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(_nbytes(x) for x in t) if isinstance(t, list | tuple) else 0


@dataclass
class CollectiveCounter:
    """Records (collective, axis) -> [calls, bytes] while active."""

    axes: dict[str, str] = field(default_factory=dict)
    counts: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    _saved: dict[str, Callable[..., Any]] = field(default_factory=dict)
    _inside: bool = False  # within a counted functional collective

    def add(self, collective: str, group: Any, nbytes: int) -> None:
        if group is None:
            group = dist.group.WORLD
        name = group if isinstance(group, str) else getattr(group, "group_name", "")
        axis = self.axes.get(name, "world" if group is dist.group.WORLD else "other")
        entry = self.counts.setdefault((collective, axis), [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def table(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {k: (v[0], v[1]) for k, v in sorted(self.counts.items())}

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed._functional_collectives as funcol

        for fn, (collective, index, key, group_index) in _FUNCTIONS.items():
            if hasattr(dist, fn):
                self._saved[fn] = getattr(dist, fn)
                setattr(dist, fn, self._wrap(self._saved[fn], collective, (index, key), group_index))
        for fn, (collective, group_index) in _FUNCTIONAL.items():
            if hasattr(funcol, fn):
                self._saved[f"funcol.{fn}"] = getattr(funcol, fn)
                setattr(funcol, fn, self._wrap_functional(getattr(funcol, fn), collective, group_index))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed._functional_collectives as funcol

        for fn, original in self._saved.items():
            setattr(funcol if fn.startswith("funcol.") else dist, fn.removeprefix("funcol."), original)
        self._saved = {}

    def _wrap(
        self, original: Callable[..., Any], collective: str, tensor_at: tuple[int, str], group_index: int
    ) -> Callable[..., Any]:
        index, key = tensor_at

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs.get(key, args[index] if len(args) > index else None)
            group = kwargs.get("group", args[group_index] if len(args) > group_index else None)
            self.add(collective, group, _nbytes(tensor))
            return original(*args, **kwargs)

        return counted

    def _wrap_functional(self, original: Callable[..., Any], collective: str, index: int) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # a deprecated alias calling its successor (all_gather_tensor -> _single): one call
                return original(*args, **kwargs)
            group = kwargs.get("group", args[index] if len(args) > index else None)
            self.add(collective, _group_name(group), _nbytes(args[0] if args else kwargs.get("self")))
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return counted


def _group_name(group: Any) -> Any:
    """A functional collective's group (a process group, its name, a 1-D mesh or (mesh, dim)) as a group name."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1]).group_name
    if isinstance(group, DeviceMesh):
        return group.get_group().group_name
    return group
