"""The fake-CUDA check: meshforge's layouts built on fake ``cuda`` tensors without a GPU (torch's CUDA build needed,
e.g. torch 2.14.1+cu130; `make test-fake-cuda`). Issues 21 item 4, 35 item 7.

Per layout: ``init_process_group`` on fake groups with the backend string training asks for (``cuda:nccl,cpu:gloo``
under CPU offload: a fake CPU backend stands for gloo) at the layout's world size (this process is rank 0), and under
``FakeTensorMode`` meshforge's own ``train.loop.setup``, then the real first step of ``run_steps``: ``train_step``
(forward, backward, clip, optimizer), the log step and the checkpoint save. Each row lists the phases passed and
the first failure with torch's message (``stopped``); a backward or a save that fails is recorded and stood in for
(zero gradients; no checkpoint) so the later phases still run. Today torch stops backward in the autograd engine,
which asks the CUDA driver for a primary context ("hasPrimaryContext expects a valid device index"), and the save
in DCP's write (".numpy() is not supported for tensor subclasses"). ``dense_1_meta_outer`` (one process) wraps the
parameters and buffers in ``MetaOuter`` (outer tensor on meta, inner fake CUDA): the engine then runs backward
(attention through the CUDA kernel's own forward / backward ops on the inner tensors) and fused AdamW steps; FSDP's
and TP's DTensor parameters cannot take the wrapper after the fact, so those layouts use stand-in gradients.
A dispatch-mode guard fails on any collective (``c10d`` / ``_c10d_functional`` op) that gets a
non-CUDA tensor (host tensors are expected, and counted apart, when the group has a CPU backend), counts host
synchronisations (``aten._local_scalar_dense`` on a CUDA tensor) per phase, host <-> device copies (blocking or
not) and pinned buffers. torch.cuda's device queries, streams and events are stubbed (no driver), the streams'
waits counted. ``activation_offload_hooks`` runs activation offload's CUDA pack and unpack directly (backward, which
unpacks, is out of reach).

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_cuda_env import STREAM_OPS, cuda_stubs, meta_outer, real_tensors_for

BASE = ["--training.steps", "1", "--training.seq_len", "64", "--training.local_batch_size", "2"]
BASE += ["--training.device", "cuda", "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dense_fsdp4": (4, ["--model.flavor", "debugmodel"]),
    "dense_1_meta_outer": (1, ["--model.flavor", "debugmodel"]),
    "dense_tp2": (2, ["--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "2"]),
    "dense_tp2_fsdp2": (4, ["--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "2"]),
    "dense_fsdp2_offload": (2, ["--model.flavor", "debugmodel", "--activation_checkpoint.offload", "true",
                                "--training.enable_cpu_offload", "true"]),
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


PHASES = ("setup", "forward", "backward", "clip", "optimizer", "log", "save")
FAKE_CPU = "fakecpu"
"""A fake backend for the host side of ``cuda:nccl,cpu:gloo`` (CPU offload's gradient norm over host shards)."""


class CollectiveGuard(TorchDispatchMode):
    """Records every collective's tensor devices and every host read of a CUDA tensor, per phase, the phases entered
    and the failures (the first one is where torch stops). ``host_backend``: the group has a CPU backend beside the
    CUDA one, so collectives on host tensors are expected (counted apart)."""

    def __init__(self, host_backend: bool = False) -> None:
        super().__init__()
        self.phase = "setup"
        self.entered = ["setup"]
        self.failures: list[str] = []
        self.failed_phases: set[str] = set()
        self.host_backend = host_backend
        self.non_cuda: list[str] = []
        self.collectives = 0
        self.host_collectives = 0
        self.pinned = 0
        self.copies: dict[str, int] = {}
        self.syncs: dict[str, int] = {}

    def enter(self, phase: str) -> None:
        self.phase = phase
        if phase not in self.entered:
            self.entered.append(phase)

    def fail(self, exc: BaseException, continued: str = "") -> None:
        message = (str(exc).splitlines() or [""])[0][:300]
        where = [ln.strip() for ln in traceback.format_exc().splitlines() if "meshforge" in ln][-1:]
        line = f"{self.phase}: {type(exc).__name__}: {message}" + (f" [at {where[0]}]" if where else "")
        self.failures.append(line + (f" (continued: {continued})" if continued else ""))
        self.failed_phases.add(self.phase)

    def passed(self) -> list[str]:
        """The phases entered and left without a failure, in order, up to the first that failed for good."""
        out = []
        for phase in self.entered:
            if phase == "done":
                break
            if phase in self.failed_phases:
                if not any(f.startswith(phase) and "(continued" in f for f in self.failures):
                    break
                continue
            out.append(phase)
        return out

    def count_copy(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Host <-> device copies, blocking or not (activation offload's must not block)."""
        key = ""
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type == "cuda":
            key = "d2h_non_blocking" if (args[2:] and args[2]) or kwargs.get("non_blocking") else "d2h_blocking"
        cuda_target = str(kwargs.get("device", "")).startswith("cuda")
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and cuda_target:
            key = "h2d_non_blocking" if kwargs.get("non_blocking") else "h2d_blocking"
        if key:
            self.copies[key] = self.copies.get(key, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._pin_memory.default or kwargs.get("pin_memory"):
            self.pinned += 1  # page-locking needs the driver: a host buffer of the same shape stands in
            if func is torch.ops.aten._pin_memory.default:
                return torch.empty_like(args[0])
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.ops.aten.is_pinned.default:
            return True
        if func is torch.ops.aten.record_stream.default:  # the caching allocator's cross-stream bookkeeping
            STREAM_OPS["record_stream"] = STREAM_OPS.get("record_stream", 0) + 1
            return None
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collectives += 1
            devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if devices == {"cpu"} and self.host_backend:
                self.host_collectives += 1
            elif devices - {"cuda"} and func is not torch.ops.c10d.barrier.default:  # barrier's: a placeholder
                where = [f"{f.filename.split('/src/')[-1]}:{f.lineno}" for f in traceback.extract_stack()]
                caller = [w for w in where if w.startswith("meshforge/")][-1:]
                self.non_cuda.append(f"{self.phase}: {func} got {sorted(devices)} tensors at {caller}")
        self.count_copy(func, args, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].device.type == "cuda":  # a host read of a host tensor is no device synchronisation
                self.syncs[self.phase] = self.syncs.get(self.phase, 0) + 1
            return 1.0 if args[0].dtype.is_floating_point else 1  # a fake tensor has no value: a stand-in
        return func(*args, **kwargs)


def check_layout(name: str, world: int, overrides: list[str], folder: Path) -> dict[str, Any]:
    """One layout through the real first step (``run_steps``: train_step, log, save); the phases it passed, the first
    that failed with torch's message, and what the guard saw."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshforge.config.io import load_config
    from meshforge.parallel.distributed import DistContext, process_group_backend
    from meshforge.train import loop

    cfg = load_config(None, [*BASE, *overrides, "--job.dump_folder", str(folder), "--checkpoint.enable", "true"])
    # the backend string training asks for (NCCL, with gloo beside it under CPU offload), on fake groups
    wanted = process_group_backend(torch.device("cuda"), "nccl", cfg.training.enable_cpu_offload)
    backend = wanted.replace("nccl", "fake").replace("gloo", FAKE_CPU)
    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=world)
    ctx = DistContext(0, world, 0, torch.device("cuda", 0), backend)
    guard = CollectiveGuard(host_backend=FAKE_CPU in backend)
    STREAM_OPS.clear()
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    # to_empty of a model without FSDP swaps each fake parameter in place, which fails on a parameter another
    # module also holds ("Couldn't swap Embedding.weight"); new Parameters instead, as a real device would give
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    result: dict[str, Any] = {"layout": name, "world": world, "backend": wanted}
    try:
        with (
            cuda_stubs(),
            mock.patch.object(loop, "init_distributed", lambda *a, **k: ctx),
            real_tensors_for(loop),
            FakeTensorMode(allow_non_fake_inputs=True),
            guard,
            meta_outer(loop) if name.endswith("meta_outer") else contextlib.nullcontext(),
        ):
            run_phases(loop, cfg, guard)
    except Exception as exc:
        guard.fail(exc)
    finally:
        dist.destroy_process_group()
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    result.update(phases=guard.passed(), reached=guard.passed()[-1] if guard.passed() else "start")
    result.update(stopped=guard.failures[0] if guard.failures else None, failures=guard.failures)
    result.update(collectives=guard.collectives, non_cuda_collectives=guard.non_cuda, host_syncs=guard.syncs)
    result.update(host_collectives=guard.host_collectives, copies=guard.copies, pinned=guard.pinned)
    result.update(stream_ops=dict(STREAM_OPS))
    return result


def run_phases(loop: Any, cfg: Any, guard: CollectiveGuard) -> None:
    """set-up, then one real step of ``run_steps``: forward, backward, clip, optimizer (train_step), log, save. A
    backward or a save that fails is recorded and stood in for (zero gradients; no checkpoint), so the phases after
    it still run."""
    state = loop.setup(cfg)
    guard.enter("forward")
    with phase_markers(loop, state, guard):
        next(loop.run_steps(state))


@contextlib.contextmanager
def phase_markers(loop: Any, state: Any, guard: CollectiveGuard) -> Iterator[None]:
    """Mark each phase where train_step / run_steps enter it; backward and save failures are recorded and passed."""
    backward = torch.autograd.backward

    def marked_backward(*args: Any, **kwargs: Any) -> None:
        guard.enter("backward")
        try:
            backward(*args, **kwargs)
        except RuntimeError as exc:  # the autograd engine needs the CUDA driver: stand-in gradients from here on
            guard.fail(exc, continued="zero gradients stand in: backward's gradient collectives did not run")
            for part in state.model_parts:
                for p in part.parameters():
                    p.grad = torch.zeros_like(p)

    def marked(phase: str, fn: Any, tolerate: str = "") -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            guard.enter(phase)
            if not tolerate:
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                guard.fail(exc, continued=tolerate)
                return None

        return run

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.autograd, "backward", marked_backward))
        stack.enter_context(mock.patch.object(loop, "clip_grad_norm_", marked("clip", loop.clip_grad_norm_)))
        stack.enter_context(mock.patch.object(loop, "step_unless", marked("optimizer", loop.step_unless)))
        stack.enter_context(mock.patch.object(state.straggler, "observe", marked("log", state.straggler.observe)))
        stack.enter_context(mock.patch.object(state.metrics, "log", marked("log", state.metrics.log)))
        if state.checkpointer is not None:
            save = marked("save", state.checkpointer.maybe_save, tolerate="no checkpoint written")
            stack.enter_context(mock.patch.object(state.checkpointer, "maybe_save", save))
        yield
    guard.enter("done")


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


def check_offload_hooks() -> dict[str, Any]:
    """parallel/activation_offload.py's CUDA path directly (backward, which would unpack, is out of reach): two
    blocks' activations and a weight packed, unpacked in backward's order (the later block first), twice (two
    micro-steps over one pool). Per micro-step: each activation copied out non-blocking into the page-locked pool
    after the side stream waited for the compute stream, recorded on the side stream; the weight not copied; the
    first unpack of the later block prefetches the earlier block's tensor on the prefetch stream (after its copy out's
    event); unpacks wait for their events on the device; the context's end waits for both streams. The pool is
    page-locked once (no torch pinned allocation) and reused; its growth costs one event synchronisation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshforge.parallel.activation_offload import Saved, StreamOffload
    from meshforge.parallel.offload_pool import PinnedPool

    guard = CollectiveGuard()
    result: dict[str, Any] = {"layout": "activation_offload_hooks", "world": 1}
    STREAM_OPS.clear()
    try:
        with cuda_stubs(), FakeTensorMode(allow_non_fake_inputs=True), guard:
            pool, blocks = PinnedPool(), [torch.nn.Identity(), torch.nn.Identity()]
            weight = torch.nn.Parameter(torch.empty(8, 8, device="cuda"))
            micro = []
            for _ in range(2):
                hooks = StreamOffload(torch.device("cuda", 0), pool, blocks)
                with hooks:
                    guard.enter("pack")
                    packed = []
                    for block in blocks:
                        block(None)  # the block's forward starts: its saved tensors are a group
                        packed.append(hooks.pack(torch.empty(4, 8, device="cuda")))
                    kept = hooks.pack(weight.t())
                    after_pack = dict(STREAM_OPS)
                    guard.enter("unpack")
                    back = [hooks.unpack(p) for p in reversed(packed)]
                micro.append({"after_pack": after_pack, "after_unpack": dict(STREAM_OPS), "copies": dict(guard.copies)})
                STREAM_OPS.clear()
                guard.copies.clear()
        result["packed_on_host"] = all(isinstance(p, Saved) and p.host.device.type == "cpu" for p in packed)
        result["weight_kept"] = kept is not None and not isinstance(kept, Saved)
        result["round_trip"] = all(b.device.type == "cuda" and b.shape == (4, 8) for b in back)
        result.update(micro_steps=micro, pool_slabs=len(pool.slabs), pool_bytes=pool.pinned_bytes, reached="unpack")
    except Exception as exc:
        guard.fail(exc)
        result["stopped"] = guard.failures[0]
    result.update(pinned=guard.pinned, copies=guard.copies, host_syncs=guard.syncs)
    result.update(collectives=guard.collectives, non_cuda_collectives=guard.non_cuda)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="layouts to check (default: all)")
    args = parser.parse_args(argv)
    if torch.version.cuda is None:
        print(f"fake-CUDA check: skipped: torch {torch.__version__} is a CPU-only build (needs a CUDA build)")
        return 0
    from torch.testing._internal.distributed import fake_pg

    if FAKE_CPU not in dist.Backend.backend_list:
        dist.Backend.register_backend(FAKE_CPU, fake_pg._create_fake_pg, extended_api=True, devices=["cpu"])
    findings = 0
    for name, (world, overrides) in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as folder:
            result = check_layout(name, world, overrides, Path(folder))
        findings += bool(result["non_cuda_collectives"])
        print(json.dumps(result), flush=True)
    for name, check in (("dense_stage_moe_balance", check_dense_stage_balance), ("offload", check_offload_hooks)):
        if not args.only or name in args.only:
            result = check()
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
