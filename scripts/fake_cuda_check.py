"""The fake-CUDA check: meshforge's layouts built on fake ``cuda`` tensors without a GPU (torch's CUDA build needed,
e.g. torch 2.14.1+cu130; `make test-fake-cuda`). Issue 21 item 4.

Per layout: ``init_process_group("fake")`` at the layout's world size (this process is rank 0), a cuda
``DeviceMesh``, and under ``FakeTensorMode`` meshforge's own ``train.loop.setup`` (model, parallelisms, optimizer,
metrics), then one forward + loss, the expert-balance step (MoE), the metrics log step, and a checkpoint save. A
dispatch-mode guard fails on any collective (``c10d`` / ``_c10d_functional`` op) that gets a non-CUDA tensor and
counts host synchronisations (``aten._local_scalar_dense`` on a CUDA tensor: ``float()``, ``.item()``, ``.tolist()``)
per phase. torch.cuda's device queries, streams and events are stubbed (no driver); ``backward()`` is out of reach
(the autograd engine asks the CUDA driver for a primary context: "hasPrimaryContext expects a valid device index").

    python scripts/fake_cuda_check.py [--only NAME...]   # one JSON line per layout, exit 1 on a finding
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
BASE = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
BASE += ["--training.device", "cuda", "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dense_fsdp4": (4, ["--model.flavor", "debugmodel"]),
    "dense_tp2_fsdp2": (4, ["--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "2"]),
    "dense_cp2_allgather": (2, ["--model.flavor", "debugmodel", *("--parallelism.context_parallel_degree", "2"),
                                "--parallelism.context_parallel_impl", "allgather"]),
    "dense_cp2_ring": (2, ["--model.flavor", "debugmodel", *("--parallelism.context_parallel_degree", "2"),
                           "--parallelism.context_parallel_impl", "ring"]),
    "dense_pp2": (2, ["--model.flavor", "debugmodel", "--parallelism.pipeline_parallel_degree", "2"]),
    "moe_ep2": (2, ["--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "2"]),
    "moe_pp4": (4, ["--model.flavor", "debugmoe", "--parallelism.pipeline_parallel_degree", "4",
                    "--training.local_batch_size", "4"]),
    "moe_ep2_tp2": (4, ["--model.flavor", "debugmoe", *("--parallelism.expert_parallel_degree", "2"),
                        "--parallelism.tensor_parallel_degree", "2"]),
}  # fmt: skip


class CollectiveGuard(TorchDispatchMode):
    """Records every collective's tensor devices and every host read of a CUDA tensor, per phase."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.non_cuda: list[str] = []
        self.collectives = 0
        self.syncs: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collectives += 1
            devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if devices - {"cuda"} and func is not torch.ops.c10d.barrier.default:  # barrier's tensor: a placeholder
                where = [f"{f.filename.split('/src/')[-1]}:{f.lineno}" for f in traceback.extract_stack()]
                caller = [w for w in where if w.startswith("meshforge/")][-1:]
                self.non_cuda.append(f"{self.phase}: {func} got {sorted(devices)} tensors at {caller}")
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].device.type == "cuda":  # a host read of a host tensor is no device synchronisation
                self.syncs[self.phase] = self.syncs.get(self.phase, 0) + 1
            return 1.0 if args[0].dtype.is_floating_point else 1  # a fake tensor has no value: a stand-in
        return func(*args, **kwargs)


class FakeCudaEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

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
        "Event": FakeCudaEvent, "current_stream": lambda *a: mock.MagicMock(), "Stream": mock.MagicMock,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "get_rng_state": lambda *a: torch.zeros(16, dtype=torch.uint8),
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
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
        yield


def check_layout(name: str, world: int, overrides: list[str], folder: Path) -> dict[str, Any]:
    """One layout through setup, forward, balance, log and save; how far it got and what the guard saw."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshforge.config.io import load_config
    from meshforge.parallel.distributed import DistContext
    from meshforge.train import loop

    cfg = load_config(None, [*BASE, *overrides, "--job.dump_folder", str(folder), "--checkpoint.enable", "true"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    ctx = DistContext(0, world, 0, torch.device("cuda", 0), "fake")
    guard, reached = CollectiveGuard(), "start"
    result: dict[str, Any] = {"layout": name, "world": world}
    try:
        with (
            cuda_stubs(),
            mock.patch.object(loop, "init_distributed", lambda *a: ctx),
            real_tensors_for(loop),
            FakeTensorMode(allow_non_fake_inputs=True),
            guard,
        ):
            reached = run_phases(loop, cfg, guard)
    except Exception as exc:
        result["stopped"] = f"{guard.phase}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        result["where"] = [line.strip() for line in traceback.format_exc().splitlines() if "meshforge" in line][-3:]
    finally:
        dist.destroy_process_group()
    result.update(reached=reached if "stopped" not in result else guard.phase, collectives=guard.collectives)
    result.update(non_cuda_collectives=guard.non_cuda, host_syncs=guard.syncs)
    return result


def run_phases(loop: Any, cfg: Any, guard: CollectiveGuard) -> str:
    """setup -> forward -> balance (MoE) -> step (no-log metrics) -> log -> save; the last phase passed."""
    from meshforge.train.moe_balance import balance_experts

    state = loop.setup(cfg)
    guard.phase = "forward"
    inputs, labels = unfaked(state.loader.next_batch)()
    inputs, labels = inputs.to(state.ctx.device), labels.to(state.ctx.device)  # fake tensors cannot be pinned
    if state.pipeline is None:
        with loop.autocast_context(state):
            loss = loop.cross_entropy(state.model_parts[0](inputs), labels)
    else:  # a pipeline schedule runs forward and backward together: out of reach; the rest of the step still runs
        loss = torch.zeros((), device=state.ctx.device)
    if state.model_args.is_moe:
        guard.phase = "balance"
        balance_experts(state.model_parts, loop.sub_mesh(state.mesh, "dp_cp"), loop.sub_mesh(state.mesh, "pp"), 1e-3)
    guard.phase = "step_without_log"
    state.metrics.add_tokens(inputs.numel(), 0.0)
    state.metrics.step_done(1, cfg.training.steps)
    guard.phase = "log"
    state.metrics.log(1, loop.global_mean(loss.detach(), state.mesh), loss.detach(), 1e-3)
    guard.phase = "save"
    state.checkpointer.save(loop.checkpoint_states(state), 1)  # type: ignore[union-attr]
    return "save"


def check_dense_stage_balance() -> dict[str, Any]:
    """train/moe_balance.py on a pipeline stage without MoE layers (rank 0 of a 2-stage cuda pp mesh): the stages'
    max of the expert load must reach the (NCCL-like) group on CUDA. Direct, as moe_pp4 stops before it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshforge.train.moe_balance import balance_experts

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    guard = CollectiveGuard()
    result: dict[str, Any] = {"layout": "dense_stage_moe_balance", "world": 2}
    try:
        with cuda_stubs():
            pp_mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("pp",))
            with FakeTensorMode(allow_non_fake_inputs=True), guard:
                guard.phase = "balance"
                balance_experts([torch.nn.Linear(8, 8, device="cuda")], None, pp_mesh, 1e-3)
        result["reached"] = "balance"
    finally:
        dist.destroy_process_group()
    result.update(collectives=guard.collectives, non_cuda_collectives=guard.non_cuda, host_syncs=guard.syncs)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="layouts to check (default: all)")
    args = parser.parse_args(argv)
    if torch.version.cuda is None:
        print(f"fake-CUDA check: skipped: torch {torch.__version__} is a CPU-only build (needs a CUDA build)")
        return 0
    findings = 0
    for name, (world, overrides) in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as folder:
            result = check_layout(name, world, overrides, Path(folder))
        findings += bool(result["non_cuda_collectives"])
        print(json.dumps(result), flush=True)
    if not args.only or "dense_stage_moe_balance" in args.only:
        result = check_dense_stage_balance()
        findings += bool(result["non_cuda_collectives"])
        print(json.dumps(result), flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: after the fake-tensor DCP saves it sometimes dies in the allocator ("malloc():
    # unsorted double linked list corrupted", SIGABRT) once every result is printed; the results decide the exit code
    os._exit(code)
