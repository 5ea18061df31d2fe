"""Checkpoints on disk: step folders committed atomically, a JSON manifest with checksums, and safe reading.

Layout of ``<dump_folder>/<checkpoint.folder>``::

    step-20/             a complete checkpoint: DCP files (.metadata, __R_I.distcp) + meshforge.json (the manifest)
    step-30.tmp/         being written (or left by a crash): never loaded, removed at the next start
    export/step-40/      the weights alone at the last step (checkpoint.last_save_model_only), same format

A save writes into ``step-N.tmp``; after every rank has written its files, rank 0 adds the manifest (step, layout,
size and CRC32 of every file) and renames the folder to ``step-N``. The rename is the commit: a folder named
``step-N`` with a manifest is complete.

Reading trusts nothing it has not checked: file sizes and CRC32s against the manifest before anything is parsed,
DCP's ``.metadata`` (a pickle, the one format DCP requires) through an unpickler that only builds DCP's own metadata
types, and tensors through DCP (``torch.load(weights_only=True)``); meshforge stores no pickled Python objects.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from meshforge.errors import ConfigError

MANIFEST = "meshforge.json"
EXPORT = "export"  # subfolder of the model-only exports (never resumed from, never pruned)
FORMAT = "meshforge-checkpoint-v1"
_STEP = re.compile(r"^step-(\d+)$")
_TMP = re.compile(r"^step-(\d+)\.tmp$")


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def tmp_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}.tmp"


def complete_steps(folder: Path) -> list[int]:
    """Steps of the committed checkpoints in folder (``step-N`` holding a manifest), ascending."""
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := _STEP.match(p.name)) and (p / MANIFEST).is_file()]
    return sorted(steps)


def remove_incomplete(folder: Path) -> list[Path]:
    """Delete the ``step-N.tmp`` folders a crash during a save left behind; returns them."""
    if not folder.is_dir():
        return []
    removed = [p for p in folder.iterdir() if _TMP.match(p.name) and p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def file_checksum(path: Path) -> dict[str, int]:
    """Size and CRC32 of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def rank_checksums(folder: Path, rank: int) -> dict[str, dict[str, int]]:
    """Checksums of the data files this rank wrote (DCP names them ``__<rank>_<i>.distcp``)."""
    return {p.name: file_checksum(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}


def commit(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest into tmp, then rename tmp to final (replacing an older checkpoint of the same step)."""
    manifest = {**manifest, "files": {**manifest["files"], ".metadata": file_checksum(tmp / ".metadata")}}
    _write_synced(tmp / MANIFEST, json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(folder: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints (keep 0: none); returns the deleted steps."""
    steps = complete_steps(folder)
    doomed = steps[:-keep] if 0 < keep < len(steps) else []
    for step in doomed:
        shutil.rmtree(step_dir(folder, step), ignore_errors=True)
    return doomed


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint folder; None when it has none (a DCP checkpoint written by another tool)."""
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"checkpoint manifest {file} is unreadable ({exc}); delete {path} or load another step"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise ConfigError(f"checkpoint manifest {file} is not a {FORMAT} manifest; delete {path} or load another step")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """Problems with this rank's share of the checkpoint's files (every ``world_size``-th file from ``rank``)."""
    problems = []
    names = sorted(manifest["files"])
    for name in names[rank::world_size]:
        want, file = manifest["files"][name], path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
            continue
        got = file_checksum(file) if file.stat().st_size == want["bytes"] else {"bytes": file.stat().st_size}
        if got["bytes"] != want["bytes"]:
            problems.append(f"{file} is truncated or padded ({got['bytes']} bytes, the manifest says {want['bytes']})")
        elif got["crc32"] != want["crc32"]:
            problems.append(f"{file} is corrupted (CRC32 {got['crc32']:08x}, the manifest says {want['crc32']:08x})")
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# Safe metadata reading
# ---------------------------------------------------------------------------------------------------------------------

_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata types, torch.Size and dtypes: a crafted .metadata cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _DCP_TYPES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a DCP metadata type")


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of a checkpoint folder, unpickled with the restricted unpickler."""
    file = path / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except FileNotFoundError:
        raise ConfigError(f"{path} is not a checkpoint: it has no .metadata file") from None
    except Exception as exc:  # any unpickling failure means a damaged or foreign file
        raise ConfigError(f"checkpoint metadata {file} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"checkpoint metadata {file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the restricted metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ConfigError(f"{self.path}: per-rank metadata (use_collectives=False checkpoints) is not supported")
        metadata = read_metadata(Path(self.path))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def saved_shapes(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    """Flattened key -> global shape of each saved tensor (None for a non-tensor entry)."""
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def check_keys(path: Path, wanted: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...] | None]) -> None:
    """One-line ValueError when the checkpoint lacks a wanted tensor, holds another shape, or has extra model
    tensors (a checkpoint of another flavor)."""
    missing = [k for k in wanted if k not in saved]  # in state-dict order: the embedding first
    shapes = [k for k in wanted if k in saved and saved[k] != wanted[k]]
    extra = [k for k in saved if k.startswith("model.") and k not in wanted]
    if not (missing or shapes or extra):
        return
    parts = []
    if shapes:
        parts.append("shape " + listing([f"{k} saved {saved[k]} vs model {wanted[k]}" for k in shapes]))
    if missing:
        parts.append("missing " + listing(missing))
    if extra:
        parts.append("unexpected " + listing(extra))
    raise ConfigError(
        f"checkpoint {path / '.metadata'} does not match this model/optimizer: {'; '.join(parts)} "
        "(a checkpoint of another model.flavor? load a matching one, or use a new checkpoint.folder)"
    )


def listing(items: list[str], limit: int = 4) -> str:
    """The first few items, comma separated, and how many more."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


# ---------------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------------


def write_checkpoint(
    state_dict: dict[str, Any], folder: Path, step: int, meta: dict[str, Any], group: dist.ProcessGroup | None
) -> Path:
    """Save ``state_dict`` as ``folder/step-N``: DCP writes into ``step-N.tmp``, then rank 0 adds the manifest and
    renames it. Collective over ``group`` when distributed; returns the committed folder."""
    tmp, final = tmp_dir(folder, step), step_dir(folder, step)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    with single_process_quiet():
        dcp.save(state_dict, storage_writer=FileSystemWriter(tmp), process_group=group, no_dist=not distributed)
    sums = rank_checksums(tmp, rank)
    gathered: list[Any] = [sums]
    if distributed:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sums, group=group)
    if rank == 0:
        commit(tmp, final, {**meta, "files": {k: v for part in gathered for k, v in part.items()}})
    if distributed:
        dist.barrier(group=group)
    return final


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (intended for a single process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
