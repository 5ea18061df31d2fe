"""Save and resume the whole training state with torch.distributed.checkpoint (DCP), in any parallel layout.

The `Checkpointer` saves and loads a mapping of named `Stateful` objects (checkpoint/stateful.py: ``model``,
``optimizer``, ``train``, ``rng``). A checkpoint holds tensors only, under the full model's parameter names, so any
layout can load it (DCP reshards):

    model.<fqn>                        parameters (DTensor shards are written by their owners)
    optimizer.state.<fqn>.<name>       optimizer state (Adam moments, step counts), flattened per parameter
    train.step / train.lr_step         the optimizer step and the lr scheduler position
    train.data.<key>                   the data loader's *global* position (it reshards across data-parallel degrees)
    rng.rank<R>.cpu / .cuda            each rank's generator states (restored when the world size is unchanged)

Model-only checkpoints (the seed at step 0, the final export) hold only ``model.*``. Optimizer hyper-parameters (lr,
betas, eps, weight decay) come from the config on resume; the lr follows the schedule from the saved position.
The on-disk format, the atomic commit and the integrity checks live in `meshforge.checkpoint.store`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from meshforge.checkpoint import hf, store
from meshforge.checkpoint.stateful import FLAT, ModelParts, TrainProgress, model_view
from meshforge.config.io import check_writable
from meshforge.config.schema import Checkpoint
from meshforge.device.dtypes import DTYPES
from meshforge.errors import ConfigError
from meshforge.threads import result

__all__ = ["FLAT", "Checkpointer", "flat_shapes", "model_view"]


def flat_shapes(state_dict: dict[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """DCP's flattened keys of a nested state dict -> global tensor shapes."""
    out: dict[str, tuple[int, ...]] = {}
    for key, value in state_dict.items():
        if isinstance(value, dict):
            out.update(flat_shapes(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tuple(value.shape)
    return out


class Checkpointer:
    """Saves every ``interval`` steps and at the last step; at start-up resumes from the latest complete checkpoint
    (or ``load_step``), else loads ``initial_load_path``. ``load``, ``save`` and ``close`` are collective."""

    def __init__(
        self,
        cfg: Checkpoint,
        *,
        dump_folder: str,
        total_steps: int,
        info: dict[str, Any],
        device: torch.device,
        timeout_s: int,
        console: bool,
    ) -> None:
        self.cfg, self.total_steps, self.info, self.device, self.console = cfg, total_steps, info, device, console
        self.folder = Path(dump_folder) / cfg.folder
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._validate()
        # checkpoint collectives get their own gloo group: async saves run them in a background thread, and writes
        # of a large model may outlast the training collectives' timeout
        timeout = datetime.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self.executor: ThreadPoolExecutor | None = None
        self.stager: Any = None
        if cfg.async_mode != "disabled":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = cfg.async_mode == "async_with_pinned_mem"
            self.stager = DefaultStager(StagingOptions(pinned, False, False, pinned))
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshforge-checkpoint")
        self.pending: Future[None] | None = None
        self.pending_step = 0
        # rank 0 deletes old checkpoints in its own thread: removing terabytes can outlast the collective timeout
        # the other ranks are already waiting under; nothing waits for it but close()
        self.pruner: ThreadPoolExecutor | None = None
        self.pruning: Future[None] | None = None

    def _validate(self) -> None:
        cfg = self.cfg
        if cfg.async_mode == "async_with_pinned_mem" and self.device.type != "cuda":
            raise ConfigError(
                "checkpoint.async_mode = 'async_with_pinned_mem' needs CUDA (pinned host memory for device copies); "
                f"this run is on {self.device.type}: use 'async'"
            )
        if cfg.create_seed_checkpoint and self.world_size > 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint runs on one process (this run has {self.world_size}); "
                "any layout can then load the seed"
            )
        if cfg.load_step >= 0 and not cfg.enable:
            raise ConfigError(f"checkpoint.load_step = {cfg.load_step} needs checkpoint.enable = true")
        if cfg.enable or cfg.create_seed_checkpoint:  # every rank writes its own shards
            check_writable(self.folder, "checkpoint.folder")

    # -- saving ----------------------------------------------------------------------------------------------------

    def maybe_save(self, states: Mapping[str, Stateful], step: int, force: bool = False) -> None:
        """Save after ``step`` when it is due: every ``interval`` steps, at the last step, or when ``force``. The last
        save is a full one (a finished run can be extended) and, with ``last_save_model_only``, also exports the
        weights alone in ``export_dtype`` to ``<folder>/export/step-<step>``."""
        if not self.cfg.enable:
            return
        last = step >= self.total_steps
        if force or last or step % self.cfg.interval == 0:
            self.save(states, step)
        if last and self.cfg.last_save_model_only:
            self.save(states, step, export=True)

    def save(
        self, states: Mapping[str, Stateful], step: int, *, model_only: bool = False, export: bool = False
    ) -> None:
        """Write ``<folder>/step-<step>`` (in the background in async mode: staged copies, then a thread); model only:
        just ``states["model"]``; export: model only, in ``export_dtype``, to ``<folder>/export/step-<step>``."""
        self.wait()
        model_only = model_only or export
        state_dict = {name: obj.state_dict() for name, obj in states.items() if not model_only or name == "model"}
        dtype = self.cfg.export_dtype if export else "float32"
        if dtype != "float32":
            state_dict["model"] = {k: v.to(DTYPES[dtype]) for k, v in state_dict["model"].items()}
        meta = {"step": step, "model_only": model_only, "dtype": dtype, "world_size": self.world_size}
        meta.update(self.info)
        folder = self.folder / store.EXPORT if export else self.folder
        if self.executor is None:
            self._write(state_dict, folder, step, meta)
        else:
            staged = self.stager.stage(state_dict)
            self.pending, self.pending_step = self.executor.submit(self._write, staged, folder, step, meta), step

    def _write(self, state_dict: dict[str, Any], folder: Path, step: int, meta: dict[str, Any]) -> None:
        start = time.perf_counter()
        final = store.write_checkpoint(state_dict, folder, step, meta, self.group)
        if self.rank == 0:
            size = sum(f.stat().st_size for f in final.iterdir()) / 2**20
            self._say(f"saved {final} ({size:.1f} MiB, {time.perf_counter() - start:.2f}s)")
            if folder == self.folder:  # exports are never pruned
                self._prune_in_background()

    def _prune_in_background(self) -> None:
        """Rank 0: delete all but the newest ``keep_latest_k`` checkpoints off the training's critical path (one
        deletion at a time, in order; the last one finishes in ``close``)."""
        if self.cfg.keep_latest_k <= 0:
            return
        if self.pruner is None:
            self.pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshforge-checkpoint-prune")

        def prune() -> None:
            pruned = store.prune(self.folder, self.cfg.keep_latest_k)
            if pruned:
                self._say(f"removed step {', '.join(map(str, pruned))} (keep_latest_k = {self.cfg.keep_latest_k})")

        self.pruning = self.pruner.submit(prune)

    def wait(self) -> None:
        """Block until the background save (if any) is committed; its error, or a finished deletion's, re-raised as
        one line naming the step (threads.result)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            result(pending, f"the background checkpoint save of step {self.pending_step} (rank {self.rank})")
        if self.pruning is not None and self.pruning.done():  # a failed deletion is reported at the next save
            pruning, self.pruning = self.pruning, None
            result(pruning, f"the deletion of old checkpoints in {self.folder} (rank 0's pruning thread)")

    def close(self) -> None:
        """Finish the last background save and deletion and release the stager and threads."""
        self.wait()
        if self.pruner is not None:
            self.pruner.shutdown()  # waits for the queued deletions
            self.pruner = None
            if self.pruning is not None:  # a failed deletion re-raised as one line
                result(self.pruning, f"the deletion of old checkpoints in {self.folder} (rank 0's pruning thread)")
        if self.executor is not None:
            self.executor.shutdown()
            self.stager.close()
            self.executor = None

    def last_good(self) -> str:
        """Where a run resumes from, in words (after a failure)."""
        steps = store.complete_steps(self.folder) if self.cfg.enable else []
        if not steps:
            return "no checkpoint was saved"
        return f"the last good checkpoint is {store.step_dir(self.folder, steps[-1])} (a re-run resumes from it)"

    # -- loading ---------------------------------------------------------------------------------------------------

    def load(self, states: Mapping[str, Stateful]) -> int:
        """Resume ``states`` from the latest complete checkpoint (or ``load_step``); without one, load the weights of
        ``initial_load_path`` into ``states["model"]``. Removes checkpoints left incomplete by a crash. Returns the
        step training continues from (0: from the start)."""
        if self.cfg.create_seed_checkpoint:
            return 0
        step = self._resume_step()
        if step >= 0:
            return self._load(states, store.step_dir(self.folder, step), weights_only=False)
        if self.cfg.initial_load_path:
            self._load_initial(states, Path(self.cfg.initial_load_path))
        return 0

    def _resume_step(self) -> int:
        if not self.cfg.enable:
            return -1
        if self.rank == 0:
            for path in [*store.remove_incomplete(self.folder), *store.remove_incomplete(self.folder / store.EXPORT)]:
                self._say(f"removed incomplete checkpoint {path}")
        self._barrier()
        steps = store.complete_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise ConfigError(
                    f"checkpoint.load_step = {self.cfg.load_step}: {self.folder} has no complete "
                    f"step-{self.cfg.load_step} (complete steps: {steps or 'none'})"
                )
            return self.cfg.load_step
        return steps[-1] if steps else -1

    def _load_initial(self, states: Mapping[str, Stateful], path: Path) -> None:
        if not path.exists():
            raise ConfigError(f"checkpoint.initial_load_path = {str(path)!r} does not exist")
        if hf.is_hf_checkpoint(path):
            model = states["model"]
            assert isinstance(model, ModelParts), "Hugging Face import needs the model parts"
            hf.load_hf_weights(model.parts, path, model.args)
            self._say(f"loaded Hugging Face weights from {path}")
            return
        if not (path / ".metadata").exists() and (steps := store.complete_steps(path)):
            path = store.step_dir(path, steps[-1])
        self._load(states, path, weights_only=True)

    def _load(self, states: Mapping[str, Stateful], path: Path, *, weights_only: bool) -> int:
        """Verify, check keys and shapes, then load ``path`` into the states (the model only when weights_only or
        the checkpoint holds only weights); returns the checkpoint's step."""
        start = time.perf_counter()
        manifest = store.read_manifest(path)
        model_only = weights_only or bool(manifest and manifest.get("model_only"))
        step = int(manifest["step"]) if manifest else 0
        if model_only and not weights_only and 0 < step < self.total_steps:
            raise ConfigError(
                f"checkpoint {path} holds only model weights (a seed or an export): it cannot resume "
                f"training to step {self.total_steps}; set checkpoint.load_step to a full checkpoint, or start a new "
                "run from these weights with checkpoint.initial_load_path"
            )
        if manifest:
            self._verify(path, manifest)
        saved = store.saved_shapes(store.read_metadata(path))
        same_world = manifest is not None and manifest.get("world_size") == self.world_size
        rng = same_world and f"rng.rank{self.rank}.cpu" in saved
        chosen = {
            name: obj for name, obj in states.items() if name == "model" or (not model_only and (name != "rng" or rng))
        }
        state_dict = {name: obj.state_dict() for name, obj in chosen.items()}
        wanted = {k: v for part in self._gather(flat_shapes(state_dict)) for k, v in part.items()}
        store.check_keys(path, wanted, saved)
        with store.single_process_quiet():
            dcp.load(state_dict, storage_reader=store.SafeReader(path), process_group=self.group)
        for name, obj in chosen.items():  # in mapping order: the model before its optimizer
            obj.load_state_dict(state_dict[name])
        if not model_only and "rng" in states and "rng" not in chosen:
            self._say("generator states not restored (none saved for this world size); seeded from training.seed")
        progress = chosen.get("train")
        if isinstance(progress, TrainProgress) and progress.loaded_step is not None:
            step = progress.loaded_step
        what = "weights" if model_only else f"step {step}"
        self._say(f"loaded {what} from {path} in {time.perf_counter() - start:.2f}s")
        return 0 if weights_only else step

    def _verify(self, path: Path, manifest: dict[str, Any]) -> None:
        checks = store.verify_files(path, manifest, self.rank, self.world_size)
        problems = [p for part in self._gather(checks) for p in part]
        if problems:
            raise ConfigError(
                f"checkpoint damaged: {problems[0]}{self._more(problems)}; delete {path} to resume "
                "from an earlier checkpoint (or set checkpoint.load_step)"
            )

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    @staticmethod
    def _more(items: list[str]) -> str:
        return f" (and {len(items) - 1} more problems)" if len(items) > 1 else ""

    def _say(self, message: str) -> None:
        if self.console:
            print(f"checkpoint: {message}", flush=True)
