"""Multi-rank probes for scripts/gpu_check.py, run under torchrun on ONE GPU (every rank on cuda:0).

    torchrun --standalone --nproc_per_node 2 scripts/gpu_check_probes.py collectives --backend gloo
    torchrun --standalone --nproc_per_node 2 scripts/gpu_check_probes.py async_tp

Rank 0 prints one line ``RESULT {json}``; an error surfaces as a traceback and a non-zero exit (the driver records
its last lines). ``--help`` works without a GPU (the driver's dry run checks that).
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


def init(backend: str) -> tuple[int, int, Any]:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)  # one GPU: every rank shares it
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60), device_id=None)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", 0)


def collectives(backend: str) -> dict[str, Any]:
    """Each collective on CUDA tensors, checked against the value it must produce."""
    import torch
    import torch.distributed as dist

    rank, world, device = init(backend)
    out: dict[str, Any] = {"backend": backend, "world_size": world}
    if backend == "nccl":
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    checks = {
        "all_reduce": lambda: _all_reduce(rank, world, device),
        "all_gather_into_tensor": lambda: _all_gather(rank, world, device),
        "reduce_scatter_tensor": lambda: _reduce_scatter(rank, world, device),
        "broadcast": lambda: _broadcast(rank, device),
        "all_to_all_single": lambda: _all_to_all(rank, world, device),
    }
    for name, check in checks.items():
        try:
            out[name] = "ok" if check() else "WRONG VALUES"
        except Exception as exc:  # record and go on: which collectives this backend has on CUDA is the finding
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
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


def _broadcast(rank: int, device: Any) -> bool:
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


def async_tp() -> dict[str, Any]:
    """meshforge's TP + sequence parallel with async TP on a small model, compiled; which fused symmetric-memory ops
    the generated code holds (inductor's micro-pipeline pass), forward and backward."""
    import torch
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.config.schema import Compile
    from meshforge.model.flavors import ModelArgs
    from meshforge.model.llama import build_model
    from meshforge.parallel.parallelize import apply_compile
    from meshforge.parallel.tensor_parallel import apply_tp

    _, world, device = init("nccl")
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    args = ModelArgs(dim=2048, n_layers=2, n_heads=16, n_kv_heads=8, vocab_size=8192, max_seq_len=2048)
    with torch.device("meta"):
        model = build_model(args)
    apply_tp(model, mesh, sequence_parallel=True, loss_parallel=False, float8=False, async_tp=True)
    apply_compile(model, Compile(enable=True))
    model.to_empty(device=device)
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (2, 2048), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        logits.float().square().mean().backward()

    _, codes = run_and_get_code(step)
    text = "\n".join(codes)
    out = {
        "world_size": world,
        "generated_modules": len(codes),
        "fused_all_gather_matmul": text.count("fused_all_gather_matmul"),
        "fused_matmul_reduce_scatter": text.count("fused_matmul_reduce_scatter"),
        "plain_all_gather_into_tensor": text.count("all_gather_into_tensor"),
        "plain_reduce_scatter_tensor": text.count("reduce_scatter_tensor"),
    }
    out["fused_ops_present"] = out["fused_all_gather_matmul"] > 0 and out["fused_matmul_reduce_scatter"] > 0
    dist.barrier()
    dist.destroy_process_group()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True)
    coll = sub.add_parser("collectives", help="every collective on CUDA tensors with one backend")
    coll.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    sub.add_parser("async_tp", help="fused async-TP ops in meshforge's compiled TP + SP blocks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = collectives(args.backend) if args.probe == "collectives" else async_tp()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
