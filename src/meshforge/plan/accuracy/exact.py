"""Exact per-rank parameter memory: the real model on the meta device, sharded for rank 0 with a fake process group.

``exact_param_numel`` runs a fresh Python process (so the fake process group never touches the caller) that builds
``meshforge.model.llama`` on the meta device, applies ``meshforge.parallel``'s tensor parallel and FSDP2 to an
N-way ``init_device_mesh("cpu", ...)`` over ``FakeStore``, and sums rank 0's local shards. No device memory is used.
Pipeline parallel is not covered here (physics/parts.py handles stages analytically).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass

from meshforge.config.io import ConfigError, load_config
from meshforge.model.flavors import get_flavor
from meshforge.model.hf_config import resolve_model_args
from meshforge.plan.layout import Layout, layout_from_config
from meshforge.plan.physics.parts import local_param_numel, rank_parts
from meshforge.plan.physics.peak import _gathered, gradient_sync_once, rank_allocated


@dataclass(frozen=True)
class ExactCase:
    """A data-parallel x tensor-parallel sharding of one flavor."""

    flavor: str
    dp_shard: int
    tp: int

    def spec(self) -> str:
        return f"{self.flavor}:{self.dp_shard}:{self.tp}"


def analytical_param_numel(case: ExactCase) -> int:
    """physics/parts.py's figure for the same sharding (what the planner uses)."""
    args = get_flavor(case.flavor)
    layout = Layout(
        flavor=case.flavor, seq_len=args.max_seq_len, local_batch_size=1, dp_shard=case.dp_shard, tp=case.tp
    )
    return local_param_numel(args, layout, rank_parts(args, layout, 0))


def exact_param_numel(cases: list[ExactCase], timeout_s: float = 180.0) -> list[int]:
    """Rank 0's parameter elements for each case, measured on the real sharded model in one subprocess."""
    cmd = [sys.executable, "-m", "meshforge.plan.accuracy.exact", *(c.spec() for c in cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"exact parameter count failed: {tail[0]}")
    return [int(n) for n in json.loads(proc.stdout.strip().splitlines()[-1])]


def _shard_rank0(case: ExactCase) -> int:
    """In this process: build, shard, count (runs in the subprocess only)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshforge.model.llama import build_model

    world = case.dp_shard * case.tp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (case.dp_shard, case.tp), mesh_dim_names=("dp_shard", "tp"))
        model = build_model(get_flavor(case.flavor))
        if case.tp > 1:
            _apply_tp(model, mesh["tp"])
        if case.dp_shard > 1:
            _apply_fsdp(model, mesh["dp_shard"])
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def _apply_tp(model: object, tp_mesh: object) -> None:
    from meshforge.parallel.tensor_parallel import apply_tp

    apply_tp(model, tp_mesh, sequence_parallel=True, loss_parallel=True, float8=False, async_tp=False)  # type: ignore[arg-type]


def _apply_fsdp(model: object, dp_mesh: object) -> None:
    from meshforge.parallel.fsdp import apply_fsdp

    apply_fsdp(model, dp_mesh, param_dtype="bfloat16", reduce_dtype="float32", reshard_after_forward=True)  # type: ignore[arg-type]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="rank 0's parameter elements under FSDP x TP (fake process group)")
    parser.add_argument("cases", nargs="+", help="flavor:dp_shard:tp")
    specs = parser.parse_args(argv).cases
    counts = []
    for spec in specs:
        flavor, dp, tp = spec.split(":")
        counts.append(_shard_rank0(ExactCase(flavor, int(dp), int(tp))))
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))


# --- per-category peak: the planner beside the exact fake-tensor step ------------------------------------------------

CATEGORY_GROUPS = {
    "parameters": ("parameters",),
    "gradients": ("gradients",),
    "optimizer": ("optimizer",),
    "activations": ("activations", "activations_inputs", "temporaries"),
    "buffers": ("parameters_unsharded", "gradients_unsharded", "all_gather", "reduce_scatter"),
}
"""The planner's categories (plan/physics/peak.py PeakTerms) as sums of the exact step's (tools/memory_run.py
CATEGORIES): the tracker files the loss's logits under activations or temporaries by where they were made, the planner
counts them with the activations."""


def exact_groups(by_category: dict[str, int]) -> dict[str, float]:
    """The exact step's bytes by the planner's categories."""
    return {k: float(sum(by_category.get(c, 0) for c in cs)) for k, cs in CATEGORY_GROUPS.items()}


def planner_groups(overrides: list[str], world_size: int) -> dict[str, float]:
    """plan/physics/peak.py's bytes at the peak of pipeline rank 0 for a config, by category (before the fitted
    slack)."""
    cfg = load_config(None, overrides)
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    layout = layout_from_config(cfg, world_size)
    t = rank_allocated(args, layout, 0)
    # torch's tracker files the unsharded gradients FSDP2 up-casts and accumulates in fp32 (its
    # unsharded_accumulated_grad) as temporaries, and those it keeps in .grad in the parameter dtype as unsharded
    # gradients: the planner's accumulated term (in its buffers) goes where the tracker files it
    upcast = layout.param_dtype != "float32" and layout.accumulate_dtype == "float32"
    accumulates = layout.pp > 1 or gradient_sync_once(layout)
    moved = _gathered(args, layout, rank_parts(args, layout, 0)).accumulated if upcast and accumulates else 0.0
    return {
        "parameters": t.parameters,
        "gradients": t.gradients,
        "optimizer": t.optimizer,
        "activations": t.activations + moved,
        "buffers": t.buffers - moved,
    }
