"""`meshforge train --dry-run --memory --by-op`: the activations one block saves for backward, per micro-batch, by
the module that saved them and the op that made them.

The step is the exact one of tools/memory_run.py (our model and ``parallelize`` on fake tensors, rank 0 of torch's
fake process group; under pipeline parallel one pipeline rank's stage config, tools/memory_pp.py), cut to two blocks
and one forward of one micro-batch. Every tensor autograd saves passes through a ``saved_tensors_hooks`` pack hook;
each storage is counted once (wq, wk and wv saving the same gathered input is one storage), attributed to the module
running when it was first saved and to the autograd node that produced it (``ToCopyBackward0``: a dtype cast;
``MmBackward0``: a matmul's output; ``input`` for tensors without one). Parameters (FSDP's unsharded weights included)
are not activations and are left out. The second block (``layers.1``) is the one reported: a block inside the stack,
fed by another block. Under activation checkpointing the checkpoint's own hooks hold what its region saves (they
take precedence over ours): a checkpointed block shows only what it keeps outside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshforge.config.schema import JobConfig
from meshforge.model.flavors import ModelArgs
from meshforge.model.llama import canonical_name
from meshforge.model.loss import cross_entropy, loss_parallel_context
from meshforge.parallel.context_parallel import resolve_cp_impl, shard_batch
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.tools.dry_run import fake_world
from meshforge.tools.memory_pp import stage_config
from meshforge.tools.memory_run import build_step_model, fake_tensors, step_autocast

MIB = 2**20
REPORTED_BLOCK = "layers.1"


@dataclass
class SavedRow:
    """Storages saved for backward under one (module, producing op, dtype) key."""

    module: str
    made_by: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int = 0
    count: int = 0

    def record(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "made_by": self.made_by,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "mib": round(self.nbytes / MIB, 3),
            "storages": self.count,
        }


@dataclass
class SavedByOp:
    """The saves of one block-micro-batch (``block``) and of the modules outside the blocks (``outside``)."""

    tokens: tuple[int, int]  # (sequences, tokens per sequence) on this rank in one micro-batch
    block: list[SavedRow] = field(default_factory=list)
    outside: list[SavedRow] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        return sum(r.nbytes for r in self.block)

    def record(self) -> dict[str, Any]:
        """The --json record's ``saved_by_op``."""
        return {
            "block": REPORTED_BLOCK,
            "micro_batch_tokens": list(self.tokens),
            "block_mib": round(self.block_bytes / MIB, 3),
            "block_rows": [r.record() for r in self.block],
            "outside_mib": round(sum(r.nbytes for r in self.outside) / MIB, 3),
            "outside_rows": [r.record() for r in self.outside],
        }


class SaveRecorder:
    """Pack hook + module stack: each saved storage once, keyed by the module first saving it and its producer."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.seen: dict[int, Any] = {}  # storage id -> the storage (kept alive so ids are not reused)
        self.rows: dict[tuple[str, str, str], SavedRow] = {}
        self.model: nn.Module | None = None

    def watch(self, model: nn.Module) -> list[Any]:
        """Forward hooks that keep ``self.modules`` the stack of running modules (canonical names)."""
        handles = []
        for name, module in model.named_modules():
            label = canonical_name(name)

            def push(*_: object, label: str = label) -> None:
                self.modules.append(label)

            def pop(*_: object) -> None:
                self.modules.pop()

            handles.append(module.register_forward_pre_hook(push, prepend=True))
            handles.append(module.register_forward_hook(pop, always_call=True))
        return handles

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):
            return t
        storage = local_tensor(t).untyped_storage()
        key = storage._cdata
        if key in self.seen or key in self.parameter_storages():
            return t
        self.seen[key] = storage
        module = self.modules[-1] if self.modules else ""
        producer = base.grad_fn or t.grad_fn  # a view of a DTensor's local shard has its grad_fn, not its base
        made_by = type(producer).__name__ if producer is not None else "input"
        dtype = str(t.dtype).removeprefix("torch.")
        row = self.rows.setdefault(
            (module, made_by, dtype), SavedRow(module, made_by, dtype, tuple(local_tensor(t).shape))
        )
        row.nbytes += storage.nbytes()
        row.count += 1
        return t

    def parameter_storages(self) -> set[int]:
        """The storages of the parameters as forward sees them now (FSDP's unsharded ones included): a parameter's
        local shard taken with ``to_local()`` is no activation either."""
        params = self.model.parameters() if self.model is not None else ()
        return {local_tensor(p).untyped_storage()._cdata for p in params}

    @contextlib.contextmanager
    def recording(self, model: nn.Module) -> Iterator[None]:
        self.model = model
        handles = self.watch(model)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            for handle in handles:
                handle.remove()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the bytes: a DTensor's local shard, an async collective's result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t


def split_rows(rows: list[SavedRow]) -> tuple[list[SavedRow], list[SavedRow]]:
    """(the reported block's rows with the block prefix removed, the rows outside every block); largest first."""
    prefix = REPORTED_BLOCK + "."
    block = [dataclasses.replace(r, module=r.module.removeprefix(prefix)) for r in rows if r.module.startswith(prefix)]
    outside = [r for r in rows if not r.module.startswith("layers.")]
    return sorted(block, key=lambda r: -r.nbytes), sorted(outside, key=lambda r: -r.nbytes)


def saved_by_op(cfg: JobConfig, world_size: int, args: ModelArgs, dims: ParallelDims) -> SavedByOp:
    """Rank 0's saves of one micro-batch's forward through a two-block model (module docstring)."""
    if dims.pp > 1:  # one pipeline rank's stage: its sub-mesh, one micro-batch per forward
        cfg, world_size = stage_config(cfg), world_size // dims.pp
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    probe = dataclasses.replace(args, n_layers=min(2, args.n_layers))
    with fake_world(world_size):
        mesh = dims.build_mesh("cpu")
        model = build_step_model(cfg, dims, mesh, probe)
        with fake_tensors():
            model.to_empty(device="cpu")
            batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
            tokens = torch.randint(0, args.vocab_size, (batch, seq))
            cp_impl = resolve_cp_impl(cfg.parallelism.context_parallel_impl, "cpu")
            tokens, labels, positions = shard_batch(sub_mesh(mesh, "cp"), cp_impl, tokens, tokens)
            loss_parallel = sub_mesh(mesh, "tp") is not None and not cfg.parallelism.disable_loss_parallel
            recorder = SaveRecorder()
            model.loss_chunks = cfg.training.loss_chunks  # type: ignore[assignment]
            with recorder.recording(model), loss_parallel_context(loss_parallel), step_autocast(cfg, model):
                if cfg.training.loss_chunks > 1:  # the loss inside forward (model/loss.py)
                    model(tokens, positions, labels)
                else:
                    cross_entropy(model(tokens, positions), labels)
    block, outside = split_rows(list(recorder.rows.values()))
    return SavedByOp((batch, tokens.shape[1]), block, outside)


def format_by_op(saved: SavedByOp) -> str:
    """The printed table."""
    sequences, tokens = saved.tokens
    lines = [
        f"saved activations of one block-micro-batch ({REPORTED_BLOCK}; {sequences} x {tokens} tokens on rank 0), "
        "each storage once (local shapes), by the module that saved it and the op that made it:",
        f"  {'module':<28} {'made by':<46} {'dtype':<9} {'shape':<22} {'MiB':>9}",
    ]
    lines += [_row(r) for r in saved.block]
    lines.append(f"  {'block total':<107} {saved.block_bytes / MIB:>9.1f}")
    lines.append("outside the blocks (embedding, final norm, output, loss), the same micro-batch:")
    lines += [_row(r) for r in saved.outside]
    return "\n".join(lines)


def _row(r: SavedRow) -> str:
    shape = "x".join(map(str, r.shape)) + (f" ({r.count})" if r.count > 1 else "")
    return f"  {r.module:<28} {r.made_by:<46} {r.dtype:<9} {shape:<22} {r.nbytes / MIB:>9.1f}"
