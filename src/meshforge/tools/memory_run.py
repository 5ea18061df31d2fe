"""`meshforge train --dry-run --memory`: exact per-rank peak memory of a training step, without devices.

The real step runs on fake tensors (``FakeTensorMode``: shapes, dtypes and storages, no bytes) as rank 0 of torch's
fake process group: our model, our ``parallelize`` (TP + SP, CP, EP, AC, FSDP2 in the one order), loss parallel,
AdamW: one whole step (which creates the optimizer states), then the forward and backward of a second step
under the tracker. torch's memory tracker
(``FSDPMemTracker`` under FSDP, ``MemTracker`` otherwise) attributes every live storage to a category at every
operator; the peak is the instant of the largest total. On real CPU tensors the same tracker reports the same bytes
(``tests/unit/test_memory_run.py`` checks it), so the figure is the tensor memory a device's caching allocator would
be asked for; the CUDA context, NCCL buffers and allocator rounding are not in it.

Scaling (stated in each record): the step runs with 2, 3 and 4 transformer blocks (``probe_layers``) and
extrapolates each category linearly from 3 and 4 to the model's ``n_layers`` (blocks are identical, so every
category is affine in the block count as long as the peak falls at the same phase; the 2-block probe checks it, and
a note says when it fails). One block is not a probe: it has no next block whose all-gather FSDP prefetches. On 8B
FSDP 8 the extrapolation equals the 32-block trace to the byte (docs/planner.md). Models of <= 4 blocks run whole.

Conventions: the peak is that of forward + backward with parameters, gradients and optimizer states resident. The
optimizer step itself is not tracked: on fake tensors its transients are over-counted (foreach kernels ~12x on
debugmodel; even the for-loop step under TP keeps about one fp32 copy of the parameters too many), and on a device
it runs after the activations are freed (params + grads + states + foreach temporaries of about one fp32 copy of the
local parameters stays far below the backward peak on every layout here). Pipeline parallel: one pipeline rank's
stage with the schedule's microbatches in flight, modelled (tools/memory_pp.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshforge.config.schema import JobConfig
from meshforge.device.precision import autocast_context
from meshforge.model.flavors import ModelArgs
from meshforge.model.llama import build_model
from meshforge.model.loss import cross_entropy, loss_parallel_context
from meshforge.parallel.activation_offload import blocks_of, is_weight
from meshforge.parallel.context_parallel import resolve_cp_impl, shard_batch
from meshforge.parallel.cpu_offload import check_cpu_offload
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.parallel.gradient_sync import keep_gathered, once_per_step, set_micro_step
from meshforge.tools.dry_run import fake_world, parallelize_meta

GIB = 2**30
# torch tracker category (value string) -> our category; activation categories start with "activations"
CATEGORIES = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Unsharded Param": "parameters_unsharded",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "Unsharded Grad": "gradients_unsharded",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Inputs": "activations_inputs",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "Temp": "temporaries",
    "Other": "temporaries",
}
FULL_RUN_LAYERS = 4  # models with at most this many blocks run whole
# under FSDP CPU offload (training.enable_cpu_offload) these torch categories live on the host, not the device
HOST_UNDER_OFFLOAD = {"Sharded Param", "Sharded Grad", "OptState", "Optstate"}
HOST = "host_"  # prefix of our categories held on the host: not in the device peak


@dataclass
class MemoryRun:
    """Peak tensor bytes of rank 0 (the busiest: coordinate 0 holds the padding rows) by category."""

    layers: int
    probes: tuple[int, ...]
    by_category: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The device peak (host-held categories under CPU offload excluded)."""
        return sum(v for k, v in self.by_category.items() if not k.startswith(HOST))

    @property
    def host_bytes(self) -> int:
        """Bytes the offloads keep on the host (FSDP CPU offload's state, activation offload's saves; 0 without)."""
        return sum(v for k, v in self.by_category.items() if k.startswith(HOST))

    def record(self) -> dict[str, Any]:
        """The --json record: ``peak_gib`` and ``by_category`` in GiB (device); under CPU offload also the bytes
        moved to the host (``host_gib``, ``host_by_category``)."""
        gib = {k: round(v / GIB, 3) for k, v in sorted(self.by_category.items())}
        host = {k.removeprefix(HOST): v for k, v in gib.items() if k.startswith(HOST)}
        return {
            "peak_gib": round(self.peak_bytes / GIB, 3),
            "by_category": {k: v for k, v in gib.items() if not k.startswith(HOST)},
            **({"host_gib": round(self.host_bytes / GIB, 3), "host_by_category": host} if host else {}),
            "layers": self.layers,
            "probe_layers": list(self.probes),
            "scaling": self.scaling(),
        }

    def scaling(self) -> str:
        if len(self.probes) == 1:
            return f"all {self.layers} blocks traced"
        *_, n1, n2 = self.probes
        return (
            f"traced {', '.join(map(str, self.probes))} blocks, each category extrapolated linearly from {n1} and {n2} "
            f"to {self.layers}"
        )


def categorize(snapshot: dict[Any, int], host: frozenset[str] = frozenset()) -> dict[str, int]:
    """A tracker snapshot of one device -> bytes per our category (the total key dropped); torch categories in
    ``host`` get the ``host_`` prefix."""
    out: dict[str, int] = {}
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name == "Total":
            continue
        category = HOST * (name in host) + CATEGORIES[name]
        out[category] = out.get(category, 0) + value
    return out


def track_device_peak(tracker: Any, host: frozenset[str]) -> dict[str, Any]:
    """Make ``tracker`` also record the snapshot at the largest total *without* the ``host`` categories (the device
    peak under CPU offload, which need not be the instant of the largest total: gradient shards keep arriving on the
    host during backward). Wraps the tracker's per-operator peak update (a private method of torch's tracker)."""
    best: dict[str, Any] = {"bytes": -1, "snapshot": {}}
    update = tracker._update_peak_stats

    def update_and_track(peak_state: Any) -> None:
        for snapshot in tracker._curr_mem_snap.values():
            on_device = sum(v for k, v in snapshot.items() if getattr(k, "value", k) not in host | {"Total"})
            if on_device > best["bytes"]:
                best.update(bytes=on_device, snapshot=dict(snapshot))
        update(peak_state)

    tracker._update_peak_stats = update_and_track
    return best


def build_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """FSDPMemTracker for an FSDP root (it sees all-gather / reduce-scatter buffers), MemTracker otherwise."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return FSDPMemTracker(model, optimizer)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def build_step_model(
    cfg: JobConfig, dims: ParallelDims, mesh: Any, args: ModelArgs, stage: tuple[bool, bool] | None = None
) -> nn.Module:
    """The model parallelized as training does it (tools/dry_run.py's options), on the meta device (FSDP2's TP
    sharding spec cannot run on fake tensors). ``stage``: (has the embedding, has norm + output), a pipeline
    stage's modules (tools/memory_pp.py)."""
    model = build_model(args)
    if stage is not None:
        model.tok_embeddings = model.tok_embeddings if stage[0] else None
        model.norm, model.output = (model.norm, model.output) if stage[1] else (None, None)
    parallelize_meta(model, cfg, dims, mesh)
    return model


def step_autocast(cfg: JobConfig, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Training's autocast (device/precision.py): without FSDP nobody casts the parameters, so a bf16 / fp16 run
    computes under autocast (its activations in that dtype, with autocast's cached casts of the weights)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = isinstance(model, FSDPModule)
    return autocast_context(cfg.training.mixed_precision_param, torch.device("cpu"), fsdp_enabled=fsdp)


def build_adamw(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """train/optim.py's AdamW hyperparameters, for-loop implementation (module docstring)."""
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, foreach=False
    )


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """FakeTensorMode for the step, with DTensor's sharding propagation kept out of the tracker's view.

    DTensor derives output metadata by running each op on global-shape fake tensors in ``detect_fake_mode() or
    FakeTensorMode()``; on real tensors that is a fresh mode above the tracker (invisible to it), under our fake mode
    it is ours, below the tracker, which then counts global-shape transients (two full-vocab fp32 logits under loss
    parallel: +15.7 GiB on 70B TP 8). A fresh mode there restores what a real run does (test_memory_run checks it)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(_sharding_prop, "detect_fake_mode", _no_mode):
        yield


def _no_mode(*_args: object) -> None:
    return None


def tracked_steps(
    cfg: JobConfig, model: nn.Module, mesh: Any, args: ModelArgs, *, init: bool = False
) -> dict[str, int]:
    """Materialize ``model`` on the current device context (fake or real CPU), run one training step (which
    creates the optimizer states), then the forward and backward of a second one under the tracker: the peak of
    that second step by category. ``init``: initialise the weights (real tensors only)."""
    model.to_empty(device="cpu")
    if init:
        model.init_weights(cfg.training.seed)  # type: ignore[operator]
    optimizer = build_adamw(model, cfg)
    batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
    generator = torch.Generator().manual_seed(0) if init else None
    inputs = torch.randint(0, args.vocab_size, (batch, seq), generator=generator)
    labels = torch.randint(0, args.vocab_size, (batch, seq), generator=generator)
    cp_impl = resolve_cp_impl(cfg.parallelism.context_parallel_impl, "cpu")
    inputs, labels, positions = shard_batch(sub_mesh(mesh, "cp"), cp_impl, inputs, labels)
    loss_parallel = sub_mesh(mesh, "tp") is not None and not cfg.parallelism.disable_loss_parallel

    chunked = cfg.training.loss_chunks > 1
    model.loss_chunks = cfg.training.loss_chunks  # type: ignore[assignment]

    offload = OffloadModel()

    def forward_backward(zero: bool = True) -> None:
        if zero:
            optimizer.zero_grad(set_to_none=True)
        with loss_parallel_context(loss_parallel), offload.hooks(cfg.activation_checkpoint.offload, blocks_of([model])):
            with step_autocast(cfg, model):
                loss = model(inputs, positions, labels) if chunked else cross_entropy(model(inputs, positions), labels)
            loss.backward()

    forward_backward()
    optimizer.step()
    tracker = build_tracker(model, optimizer)
    if hasattr(tracker, "track_inputs"):  # FSDPMemTracker; MemTracker counts them as "Other" when first seen
        tracker.track_inputs((inputs, labels))
    host = frozenset(HOST_UNDER_OFFLOAD if cfg.training.enable_cpu_offload else ())
    device_peak = track_device_peak(tracker, host)
    offload.peak = 0
    with tracker:
        accumulate_once_per_step(cfg, model, forward_backward, getattr(tracker, "reset_mod_stats", lambda: None))
        after = tracker.get_tracker_snapshot()  # the host side once every gradient shard arrived
    snapshot = tracker.get_tracker_snapshot("peak")
    assert len(snapshot) == 1, f"one device expected, tracker saw {list(snapshot)}"
    saved = {f"{HOST}activations_saved": offload.peak} if cfg.activation_checkpoint.offload else {}
    if not host:
        return categorize(next(iter(snapshot.values()))) | saved
    on_device = {k: v for k, v in categorize(device_peak["snapshot"], host).items() if not k.startswith(HOST)}
    after_host = {k: v for k, v in categorize(next(iter(after.values())), host).items() if k.startswith(HOST)}
    return on_device | after_host | saved


class OffloadModel:
    """Activation offload (``activation_checkpoint.offload``, parallel/activation_offload.py) on the fake device, where
    host and device are one: each saved activation is dropped at pack (its bytes counted as held on the host) and
    allocated again when backward brings it back: the blocks before the last at the first unpack of the block after
    them (training's prefetch), the rest at their own unpack. Weights stay (``is_weight``), as in training."""

    def __init__(self) -> None:
        self.live = self.peak = self.block = 0
        self.groups: dict[int, list[list[Any]]] = {}
        self.fetched: set[int] = set()

    def pack(self, t: torch.Tensor) -> Any:
        if is_weight(t):
            return t
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        entry = [t.shape, t.stride(), t.dtype, t.device, nbytes, self.block, None]
        self.groups.setdefault(self.block, []).append(entry)
        return entry

    def unpack(self, entry: Any) -> torch.Tensor:
        if isinstance(entry, torch.Tensor):
            return entry
        if entry[5] - 1 not in self.fetched:  # the block before comes back now, ahead of its backward
            self.fetched.add(entry[5] - 1)
            for other in self.groups.get(entry[5] - 1, []):
                other[6] = self.arrive(other) if other[6] is None else other[6]
        back, entry[6] = (entry[6] if entry[6] is not None else self.arrive(entry)), None
        return back

    def arrive(self, entry: list[Any]) -> torch.Tensor:
        shape, stride, dtype, device, nbytes = entry[:5]
        self.live -= nbytes
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    def _next_block(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.block += 1

    def hooks(self, enabled: bool, blocks: list[nn.Module]) -> contextlib.AbstractContextManager[Any]:
        if not enabled:
            return contextlib.nullcontext()
        return self.hooked(blocks)

    @contextlib.contextmanager
    def hooked(self, blocks: list[nn.Module]) -> Iterator[None]:
        self.block, self.groups, self.fetched = 0, {}, set()
        handles = [block.register_forward_pre_hook(self._next_block) for block in blocks]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for handle in handles:
                handle.remove()


def accumulate_once_per_step(
    cfg: JobConfig, model: nn.Module, forward_backward: Callable[..., None], between: Callable[[], None]
) -> None:
    """The tracked step's forward and backward. Under gradient_sync once per step (parallel/gradient_sync.py) a
    non-last micro-step first, then the last one on top of its unsharded gradients (and, with regather = keep, its
    gathered parameters): the peak then counts what skipping the exchange keeps resident (torch's tracker files the
    accumulated unsharded gradients as temporaries: about the whole model in fp32 per rank). ``between``: the tracker's
    per-module reset (FSDPMemTracker follows one forward per module; its peak is kept)."""
    if not once_per_step(cfg.gradient_sync, cfg.training.gradient_accumulation_steps):
        forward_backward()
        return
    keep = keep_gathered(cfg.gradient_sync)
    set_micro_step([model], last=False, keep=keep)
    forward_backward()
    between()
    set_micro_step([model], last=True, keep=keep)
    forward_backward(zero=False)


def probe_layers(n_layers: int) -> tuple[int, ...]:
    """The block counts traced (module docstring)."""
    return (n_layers,) if n_layers <= FULL_RUN_LAYERS else (2, 3, 4)


def extrapolate(first: dict[str, int], second: dict[str, int], n1: int, n2: int, n: int) -> dict[str, int]:
    """Each category affine in the block count through (n1, first) and (n2, second), at n."""
    keys = sorted(set(first) | set(second))
    out = {}
    for key in keys:
        a, b = first.get(key, 0), second.get(key, 0)
        out[key] = max(0, b + (b - a) * (n - n2) // (n2 - n1))
    return out


def memory_run(cfg: JobConfig, world_size: int, args: ModelArgs, dims: ParallelDims) -> MemoryRun:
    """Rank 0's peak by category for ``cfg`` on ``world_size`` ranks (fake tensors, fake process group), without
    pipeline parallel (tools/memory_pp.py traces a pipeline's stages; tools/memory_cli.py picks one)."""
    if dims.pp > 1:
        raise ValueError("memory_run traces the whole model: a pipeline's stages are memory_pp.pp_memory_run's")
    check_cpu_offload(cfg.training.enable_cpu_offload, fsdp_enabled=dims.fsdp_enabled)

    def trace(n: int) -> list[dict[str, int]]:
        probe_args = dataclasses.replace(args, n_layers=n)
        with fake_world(world_size):
            mesh = dims.build_mesh("cpu")
            model = build_step_model(cfg, dims, mesh, probe_args)
            with fake_tensors():
                return [tracked_steps(cfg, model, mesh, probe_args)]

    return probed_run(args.n_layers, trace)


def probed_run(layers: int, trace: Callable[[int], list[dict[str, int]]]) -> MemoryRun:
    """``trace`` (bytes by category of a model with n blocks, at each candidate instant of the step: the tracker's
    peak, and where a caller knows one, another instant such as a pipeline stage's forwards all held) at the probe
    block counts, each instant extrapolated to ``layers`` on its own, the largest total kept: the instant that peaks
    on a few probe blocks need not be the one that peaks on the whole model (a pipeline stage's end of backward,
    with the embedding's gradient, outweighs its held forwards on 3 blocks, not on 20)."""
    probes = probe_layers(layers)
    traced = [trace(n) for n in probes]
    if len(probes) == 1:
        return MemoryRun(layers, probes, max(traced[0], key=lambda c: sum(c.values())))
    runs = []
    for phase in range(len(traced[0])):
        peaks = [t[phase] for t in traced]
        run = MemoryRun(layers, probes, extrapolate(peaks[1], peaks[2], probes[1], probes[2], layers))
        if extrapolate(peaks[0], peaks[1], probes[0], probes[1], probes[2]) != peaks[2]:
            run.notes.append(f"the {probes} block probes are not affine in the block count: the scaling is approximate")
        runs.append(run)
    return max(runs, key=lambda r: r.peak_bytes)


def real_cpu_peak(cfg: JobConfig, world_size: int, args: ModelArgs, dims: ParallelDims) -> dict[str, int]:
    """The same tracked step on real CPU tensors (small models only): the check that fake bytes are real bytes."""
    with fake_world(world_size):
        mesh = dims.build_mesh("cpu")
        return tracked_steps(cfg, build_step_model(cfg, dims, mesh, args), mesh, args, init=True)


def fake_cpu_peak(cfg: JobConfig, world_size: int, args: ModelArgs, dims: ParallelDims) -> dict[str, int]:
    """All blocks of ``args`` traced once on fake tensors (no scaling)."""
    with fake_world(world_size):
        mesh = dims.build_mesh("cpu")
        model = build_step_model(cfg, dims, mesh, args)
        with fake_tensors():
            return tracked_steps(cfg, model, mesh, args)


def format_memory(run: MemoryRun) -> str:
    """The printed breakdown."""
    lines = [f"exact peak memory of rank 0 (fake-tensor training step, {run.scaling()}):"]
    for key, value in sorted(run.by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {key:<22} {value / GIB:>8.2f} GiB")
    lines.append(f"  {'peak':<22} {run.peak_bytes / GIB:>8.2f} GiB (tensors only: no CUDA context, NCCL, rounding)")
    if run.host_bytes:
        lines.append(f"  {'on the host':<22} {run.host_bytes / GIB:>8.2f} GiB (offloaded: off the device)")
    lines += [f"note: {n}" for n in run.notes]
    return "\n".join(lines)
