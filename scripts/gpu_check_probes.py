"""Multi-rank probes for scripts/gpu_check.py, run under torchrun on ONE GPU (every rank on cuda:0).

    torchrun --standalone --nproc_per_node 2 scripts/gpu_check_probes.py collectives --backend gloo
    torchrun --standalone --nproc_per_node 2 scripts/gpu_check_probes.py cp_attention --seq 8192 32768

Rank 0 prints one line ``RESULT {json}`` with ``correct`` (true only when every value matched its reference); an error
surfaces as a traceback and a non-zero exit (the driver records its last lines). The backend of ``cp_attention`` is
``$MESHFORGE_CUDA_BACKEND`` (default nccl), as for meshforge train. ``set_up`` is what the driver's dry run checks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
CP_TOLERANCE = 2e-2
"""Relative L2 error allowed between a CP core and dense causal SDPA, both bf16 (bf16 rounding: ~4e-3)."""
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128


def init(backend: str, device_type: str = "cuda") -> tuple[int, int, Any]:
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)  # one GPU: every rank shares it
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size(), torch.device(device_type, 0 if device_type == "cuda" else None)


def cp_cores() -> tuple[Any, Any, Any]:
    """(AllGatherKVAttention, RingAttention, load_balanced_positions) wherever the CP package keeps them."""
    import importlib

    for gather_mod, ring_mod in (
        ("meshforge.parallel.context_parallel", "meshforge.parallel.context_parallel"),
        ("meshforge.parallel.context_parallel.api", "meshforge.parallel.context_parallel.ring"),
        ("meshforge.parallel.context_parallel.context_parallel", "meshforge.parallel.context_parallel.ring_attention"),
        ("meshforge.parallel.context_parallel", "meshforge.parallel.ring_attention"),
    ):
        try:
            gather, ring = importlib.import_module(gather_mod), importlib.import_module(ring_mod)
            return gather.AllGatherKVAttention, ring.RingAttention, gather.load_balanced_positions
        except (ImportError, AttributeError):
            continue
    raise ImportError("meshforge's CP cores (AllGatherKVAttention, RingAttention) not found")


def collectives(backend: str) -> dict[str, Any]:
    """Each collective on CUDA tensors, checked against the value it must produce."""
    import torch
    import torch.distributed as dist

    rank, world, device = init(backend)
    out: dict[str, Any] = {"backend": backend, "world_size": world}
    if backend == "nccl":
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    ops: dict[str, Any] = {}
    for name, check in COLLECTIVES.items():  # point-to-point last: on gloo with CUDA tensors it breaks the pair
        try:
            ops[name] = "ok" if check(rank, world, device) else "WRONG VALUES"
        except Exception as exc:  # record and go on: which collectives this backend has on CUDA is the finding
            ops[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    out["ops"], out["correct"] = ops, not any(v == "WRONG VALUES" for v in ops.values())
    out["unsupported"] = sorted(k for k, v in ops.items() if v not in ("ok", "WRONG VALUES"))
    try:  # after a refused or broken collective the group may be unusable: the ops' record above is the result
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:
        out["teardown"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def funcol(backend: str) -> dict[str, Any]:
    """A functional all-gather (what DTensor / tensor parallel and meshforge's CP all-gather run) on CUDA tensors.
    On gloo (torch 2.11.0+cu130, H200, 2026-12-04) it killed both ranks with SIGSEGV in ``wait_tensor``: the
    driver then says TP and CP need two GPUs rather than reporting their crash as a failure."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    rank, world, device = init(backend)
    got = fc.all_gather_tensor(torch.full((4,), float(rank), device=device), 0, dist.group.WORLD)
    want = torch.arange(world, device=device, dtype=torch.float32).repeat_interleave(4)
    out = {"backend": backend, "correct": bool(torch.equal(got, want))}
    dist.barrier()
    dist.destroy_process_group()
    return out


def _all_reduce(rank: int, world: int, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(t)
    return bool((t == world * (world + 1) / 2).all())


def _all_gather(rank: int, world: int, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    out = torch.empty(world * 4, device=device)
    dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=device))
    return bool(torch.equal(out.cpu(), torch.arange(world).repeat_interleave(4).float()))


def _reduce_scatter(rank: int, world: int, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    out = torch.empty(4, device=device)
    dist.reduce_scatter_tensor(out, torch.ones(world * 4, device=device))
    return bool((out == world).all())


def _broadcast(rank: int, world: int, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.full((8,), 7.0 if rank == 0 else 0.0, device=device)
    dist.broadcast(t, src=0)
    return bool((t == 7.0).all())


def _all_to_all(rank: int, world: int, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    src = torch.full((world,), float(rank), device=device)
    out = torch.empty(world, device=device)
    dist.all_to_all_single(out, src)
    return bool(torch.equal(out.cpu(), torch.arange(world).float()))


def _send_recv(rank: int, world: int, device: Any) -> bool:
    """The ring's neighbour exchange (parallel/context_parallel/ring.py)."""
    import torch
    import torch.distributed as dist

    recv = torch.empty(16, device=device)
    ops = [
        dist.P2POp(dist.isend, torch.full((16,), float(rank), device=device), (rank + 1) % world),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return bool((recv == float((rank - 1) % world)).all())


COLLECTIVES = {
    "all_reduce": _all_reduce,
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "broadcast": _broadcast,
    "all_to_all_single": _all_to_all,
    "batch_isend_irecv": _send_recv,
}


def rel_error(got: Any, want: Any) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def cp_case(impl: str, seq: int, mesh: Any, rank: int, cp: int) -> dict[str, float]:
    """One CP core at one length vs dense causal SDPA on the same device (bf16): relative errors of out, dq, dk, dv."""
    import torch
    import torch.nn.functional as F

    AllGatherKVAttention, RingAttention, load_balanced_positions = cp_cores()
    device = mesh.device_type
    gen = torch.Generator(device=device).manual_seed(seq)
    shapes = [(1, HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM)]
    q, k, v = (torch.randn(s, device=device, generator=gen, dtype=torch.bfloat16) for s in shapes)
    dout = torch.randn(shapes[0], device=device, generator=gen, dtype=torch.bfloat16)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = HEADS // KV_HEADS
    dense_kv = [t.repeat_interleave(groups, dim=1) for t in full[1:]]
    want = F.scaled_dot_product_attention(full[0], *dense_kv, is_causal=True)
    want.backward(dout)
    pos = load_balanced_positions(seq, cp, rank, torch.device(device))
    local = [t[:, :, pos].detach().clone().requires_grad_() for t in (q, k, v)]
    core = AllGatherKVAttention(mesh) if impl == "allgather" else RingAttention(mesh)
    out = core(*local)
    out.backward(dout[:, :, pos])
    errors = {"out": rel_error(out, want.detach()[:, :, pos])}
    for name, mine, ref in zip(("dq", "dk", "dv"), local, full, strict=True):
        errors[name] = rel_error(mine.grad, ref.grad[:, :, pos])  # type: ignore[index]
    return {key: round(value, 5) for key, value in errors.items()}


RING_ON_GLOO_CUDA = (
    "skipped: gloo has no CUDA send/recv (batch_isend_irecv reads device pointers without staging through the "
    "host); the ring runs on NCCL only, so it is untested in this window"
)
"""The one line a ring case gets when the multi-rank checks fell back to gloo on CUDA ("Duplicate GPU")."""


def ring_unsupported(device_type: str, backend: str) -> bool:
    """Ring CP cannot run here: gloo on CUDA tensors (the "Duplicate GPU" fallback) has no device send/recv."""
    return device_type == "cuda" and backend == "gloo"


def run_case(impl: str, seq: int, mesh: Any, rank: int, cp: int) -> tuple[Any, bool]:
    """One case, isolated: (its errors, or the one line of what went wrong / why it was skipped; whether it ran)."""
    import torch.distributed as dist

    if impl == "ring" and ring_unsupported(mesh.device_type, dist.get_backend()):
        return RING_ON_GLOO_CUDA, False
    try:
        return cp_case(impl, seq, mesh, rank, cp), True
    except Exception as exc:  # the other cases' results stand; the error is this case's finding
        return f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}", False


def cp_attention(seqs: list[int], device_type: str = "cuda") -> dict[str, Any]:
    """Both CP cores at each length, forward and backward, on cp = world size ranks of one device; each case isolated
    (a failing or skipped case is one line in the results, ``correct`` false when any case failed)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    backend = os.environ.get("MESHFORGE_CUDA_BACKEND", "nccl") if device_type == "cuda" else "gloo"
    rank, cp, _ = init(backend, device_type)
    mesh = init_device_mesh(device_type, (cp,), mesh_dim_names=("cp",))
    out: dict[str, Any] = {"backend": backend, "cp": cp, "tolerance": CP_TOLERANCE}
    worst, failed = 0.0, 0.0
    for seq in seqs:
        for impl in ("allgather", "ring"):
            result, ran = run_case(impl, seq, mesh, rank, cp)
            out[f"{impl}_seq{seq}"] = result
            if ran:
                worst = max(worst, *result.values())
            elif result.startswith("failed"):
                failed = 1.0
            if device_type == "cuda":
                torch.cuda.empty_cache()
    verdict = torch.tensor([worst, failed], device=device_type)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # the worst rank decides
    out["max_rel_error"], out["cases_failed"] = float(verdict[0]), bool(verdict[1])
    out["correct"] = out["max_rel_error"] <= CP_TOLERANCE and not out["cases_failed"]
    if device_type == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    dist.destroy_process_group()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True)
    coll = sub.add_parser("collectives", help="every collective on CUDA tensors with one backend")
    coll.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    fun = sub.add_parser("funcol", help="a functional all-gather (DTensor's, CP's) on CUDA tensors")
    fun.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    cp = sub.add_parser("cp_attention", help="CP all-gather and ring, fwd + bwd, vs dense causal SDPA (bf16)")
    cp.add_argument("--seq", type=int, nargs="+", required=True)
    cp.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, for tests")
    return parser


def set_up(args: argparse.Namespace, cp: int = 2) -> None:
    """What a probe needs before its GPU work, checked without a GPU (the driver's dry run): imports and shapes."""
    import torch.distributed as dist

    assert dist.is_available(), "torch.distributed is missing"
    if args.probe == "cp_attention":
        AllGatherKVAttention, RingAttention, load_balanced_positions = cp_cores()

        assert AllGatherKVAttention and RingAttention
        for seq in args.seq:
            assert seq % (2 * cp) == 0, f"--seq {seq} must split into {2 * cp} chunks"
            assert len(load_balanced_positions(seq, cp, cp - 1)) == seq // cp
    else:
        import torch

        cuda_build = torch.version.cuda is not None  # a CPU-only build has no NCCL: nothing to check there
        assert not cuda_build or dist.is_backend_available(args.backend), f"backend {args.backend} missing"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe == "cp_attention":
        result = cp_attention(args.seq, args.device)
    else:
        result = (collectives if args.probe == "collectives" else funcol)(args.backend)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
