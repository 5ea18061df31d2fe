"""The named objects a checkpoint holds, each a `torch.distributed.checkpoint.stateful.Stateful` (``state_dict`` /
``load_state_dict``) whose state dict holds tensors only, under layout-independent keys:

    model        ModelParts      the full model's parameter names over this rank's parts (DTensor shards)
    optimizer    OptimizerState  optimizer state flattened per parameter (``state.<fqn>.<name>``)
    train        TrainProgress   ``step``, ``lr_step`` (the scheduler position) and ``data.<key>`` (the loader's
                                 *global* position, which reshards across data-parallel degrees)
    rng          RNGState        ``rank<R>.cpu`` / ``.cuda`` generator states

The `Checkpointer` saves and loads a mapping of these by name; it never sees the training loop's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshforge.model.flavors import ModelArgs

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Resumable(Protocol):
    """What a data loader offers to be saved: its position as integers, and a way back to it."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


def model_view(parts: list[nn.Module]) -> nn.Module:
    """One module with the full model's parameter names over this rank's model parts: the part itself, or (several
    pipeline stages on one rank) a container sharing their submodules. Stage FQNs equal the full model's."""
    if len(parts) == 1:
        return parts[0]
    assert not any(part._parameters for part in parts), "model parts must not own parameters directly"
    view = nn.Module()
    names = dict.fromkeys(name for part in parts for name, _ in part.named_children())
    for name in names:
        children = [child for part in parts if (child := part._modules.get(name)) is not None]
        view.add_module(name, model_view(children))
    return view


class ModelParts:
    """This rank's model parts (one, or its pipeline stages) under the full model's names; ``args`` describes the
    model (Hugging Face import needs it)."""

    def __init__(self, parts: list[nn.Module], args: ModelArgs) -> None:
        self.parts, self.args, self.view = parts, args, model_view(parts)

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.view)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.view, state_dict)


class OptimizerState:
    """The optimizer's per-parameter state (Adam moments, step counts), flattened under parameter names.
    Hyper-parameters (lr, betas, weight decay) are not saved: they come from the config on resume."""

    def __init__(self, model: ModelParts, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def _flat(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model.view, self.optimizer, options=FLAT)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self._flat().items() if k.startswith("state.")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = {k: v for k, v in self._flat().items() if not k.startswith("state.")}
        set_optimizer_state_dict(self.model.view, self.optimizer, {**groups, **state_dict}, options=FLAT)


class TrainProgress:
    """Where training is: the optimizer step, the lr scheduler's position and the data loader's position.
    After ``load_state_dict``, ``loaded_step`` holds the step to continue from."""

    def __init__(
        self, step: Callable[[], int], scheduler: torch.optim.lr_scheduler.LRScheduler, loader: Resumable
    ) -> None:
        self.step, self.scheduler, self.loader = step, scheduler, loader
        self.loaded_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        train = {"step": self.step(), "lr_step": self.scheduler.last_epoch}
        train.update({f"data.{k}": v for k, v in self.loader.state_dict().items()})
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in train.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        train = {k: int(v) for k, v in state_dict.items()}
        self.loaded_step = train["step"]
        self.loader.load_state_dict({k.removeprefix("data."): v for k, v in train.items() if k.startswith("data.")})
        # the scheduler's own step computes the lr at the saved position (bitwise what an uninterrupted run has)
        position = {"last_epoch": train["lr_step"] - 1, "_step_count": train["lr_step"] + 1}
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **position})
        self.scheduler.step()


class RNGState:
    """This rank's generator states (CPU, and the CUDA device's), saved under ``rank<R>``: a rank restores only its
    own, so they are loaded only when the world size is unchanged."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device

    def state_dict(self) -> dict[str, Any]:
        generators = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            generators["cuda"] = torch.cuda.get_rng_state(self.device)
        return {f"rank{self.rank}": generators}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        generators = state_dict[f"rank{self.rank}"]
        torch.set_rng_state(generators["cpu"])
        if "cuda" in generators:
            torch.cuda.set_rng_state(generators["cuda"], self.device)
