"""ParallelDims: the validated parallel degrees, the rank grid and the DeviceMesh built from them.

The rank grid is ``arange(world).reshape(pp, dp_replicate, dp_shard, cp, tp)`` (tp innermost, so tensor-parallel ranks
are neighbours on one host). Only axes of size > 1 become mesh axes; flattened axes give the strategies their groups:
``dp`` (replicate x shard: data loading), ``dp_shard_cp`` (shard x cp: FSDP sharding), ``dp_cp`` (loss averaging).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.config.schema import Float8, Parallelism
from meshforge.errors import ConfigError
from meshforge.parallel import composability
from meshforge.parallel.context_parallel import check_cp_impl
from meshforge.parallel.degrees import Degrees, check_ep_compile, check_ep_degrees, degrees_from_config
from meshforge.parallel.float8 import check_float8_support

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims(Degrees):
    """Degrees of each parallel axis (parallel/degrees.py: their sizes), with the rank grid, the checks against the
    model and the features, and the DeviceMesh."""

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> ParallelDims:
        """Resolve data_parallel_shard_degree = -1 and check that the degrees multiply to the world size."""
        return cls(**dataclasses.asdict(degrees_from_config(cfg, world_size)))

    def validate_ep(self) -> None:
        """Expert parallel borrows from the data-parallel shard x context ranks (parallel/degrees.py)."""
        check_ep_degrees(self.ep, self.dp_shard, self.cp, self.dp_replicate)

    def degree(self, axis: str) -> int:
        return int(getattr(self, axis))

    def coords(self, rank: int) -> dict[str, int]:
        """The position of a rank on each axis of the grid."""
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            size = self.degree(axis)
            out[axis] = rank % size
            rank //= size
        return out

    def dp_rank(self, rank: int) -> int:
        """Index of a rank among the data-parallel groups (what slice of the global batch it reads)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def validate_features(
        self,
        parallelism: Parallelism,
        *,
        device: torch.device,
        compile_enabled: bool,
        float8: Float8,
        features: Sequence[str] = (),
    ) -> None:
        """Options that need particular hardware or other options, checked once the device is known: never a silent
        no-op. ``features``: the job's other composability columns (composability.job_features: AC, chunked loss,
        document mask, ...), refused here as the table says."""
        if parallelism.enable_async_tensor_parallel:
            fix = "set parallelism.enable_async_tensor_parallel = false"
            if self.tp == 1:
                raise ConfigError(f"async tensor parallel needs parallelism.tensor_parallel_degree > 1; {fix}")
            if not parallelism.enable_sequence_parallel:
                raise ConfigError(
                    "async tensor parallel needs parallelism.enable_sequence_parallel = true (its all-gather + matmul "
                    f"and matmul + reduce-scatter patterns exist only under sequence parallel); {fix}"
                )
            if device.type != "cuda":
                raise ConfigError(
                    f"async tensor parallel needs CUDA symmetric memory, the device is {device.type}; {fix}"
                )
            if not compile_enabled:
                raise ConfigError(
                    f"async tensor parallel needs compile.enable = true (inductor does the overlap); {fix}"
                )
        if self.cp > 1:
            check_cp_impl(parallelism.context_parallel_impl, device.type, compile_enabled=compile_enabled)
        check_ep_compile(self.ep, compile_enabled)
        check_float8_support(float8, device)
        self.check_composability(
            parallelism, compile_enabled=compile_enabled, float8=float8, features=features, device_type=device.type
        )

    def check_composability(
        self,
        parallelism: Parallelism,
        *,
        compile_enabled: bool,
        float8: Float8,
        features: Sequence[str] = (),
        device_type: str = "",
    ) -> None:
        """The composability table's refusals for this layout's compile / Float8 and ``features``
        (parallel/composability.py)."""
        own = (["compile"] if compile_enabled else []) + ([f"float8_{float8.recipe_name}"] if float8.enable else [])
        features = list(dict.fromkeys([*own, *features]))
        cp_impl = parallelism.context_parallel_impl
        rows = composability.active_parallelisms(
            parallelism,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            cp_impl=cp_impl,
        )
        composability.check(rows, features, device_type)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named DeviceMesh over the axes of size > 1 (None for a single process), with the flattened axes."""
        names = tuple(axis for axis in AXES if self.degree(axis) > 1)
        if not names:
            return None
        mesh = init_device_mesh(device_type, tuple(self.degree(a) for a in names), mesh_dim_names=names)
        for flat, parts in FLATTENED.items():
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present]._flatten(flat)
        return mesh

    def build_expert_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The 2-D (efsdp, ep) mesh of the routed experts, an unflattening of dp_shard x cp (ep innermost: expert
        peers are neighbours); None without expert parallel. Same root as ``mesh``, so FSDP can shard the experts'
        ep-sharded DTensors over efsdp."""
        if self.ep == 1:
            return None
        assert mesh is not None
        names = mesh.mesh_dim_names or ()
        base = "dp_shard_cp" if "dp_shard" in names and "cp" in names else ("dp_shard" if "dp_shard" in names else "cp")
        return mesh[base]._unflatten(0, (self.efsdp, self.ep), ("efsdp", "ep"))


def sub_mesh(mesh: DeviceMesh | None, *axes: str) -> DeviceMesh | None:
    """The sub-mesh over the given axes (flattened names allowed), skipping size-1 axes; None if none remain."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    parts: list[str] = []
    for axis in axes:
        if axis in names:
            parts.append(axis)
        elif axis in FLATTENED:
            present = [p for p in FLATTENED[axis] if p in names]
            parts += [axis] if len(present) > 1 else present
    if not parts:
        return None
    return mesh[tuple(parts)] if len(parts) > 1 else mesh[parts[0]]
