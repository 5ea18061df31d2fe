"""Fault-tolerant data-parallel replicas on torchft: each replica group (FSDP / TP inside it) is one replica of the
replicate dimension of HSDP; torchft's Manager forms a quorum of the live groups through the Lighthouse every step,
all-reduces the gradient shards across them (NCCL on CUDA, gloo on CPU: ``replica_process_group``) and
live-recovers a (re)joining group from a healthy peer.

Per step (train/loop.py calls these): ``start_step`` (the quorum; a recovering group receives the peer's model
shards, optimizer state, lr-scheduler position, data-loader position and step here, before it reads a batch),
``sync_gradients`` (one flat all-reduce of this rank's gradient shards over the quorum, averaged by the number of
participants), ``should_commit`` (every rank of every live group agrees the step succeeded; if not, the step is
retried with the same batch: the loader is rewound, the update discarded, the step number reused).

Rank r of group g is paired with rank r of every other group (the same layout in each: checked in the quorum). The
data is split over group_size x dp slots: group g's dp rank d reads slot g x dp + d, so the groups train different
samples; all groups advance the global position together (a dead group's slot is skipped while it is down).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshforge.config.fault_tolerance import check_lighthouse_url
from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.model.moe import moe_layers
from meshforge.observability.metrics import log_step
from meshforge.parallel.distributed import report_once
from meshforge.train.ft_clock import NO_QUORUM_EXIT, give_up_when_stuck

if TYPE_CHECKING:
    from meshforge.train.loop import TrainState

INSTALL = "pip install 'meshforge[ft]' (or pip install torchft==0.2.0)"


def import_torchft() -> Any:
    """torchft, or a one-line ConfigError with the install command."""
    try:
        import torchft
    except ImportError:
        raise ConfigError(f"fault_tolerance.enable = true needs the torchft package: {INSTALL}") from None
    return torchft


def replica_name(cfg: JobConfig, world_size: int) -> str:
    """The id this group announces: its group size, its layout when not plain FSDP (``-pp2-tp1-cp1-ep1``) and its
    replica id (torchft takes the trailing digits as the id)."""
    par = cfg.parallelism
    degrees = [("pp", par.pipeline_parallel_degree), ("tp", par.tensor_parallel_degree)]
    degrees += [("cp", par.context_parallel_degree), ("ep", par.expert_parallel_degree)]
    tag = "".join(f"-{axis}{d}" for axis, d in degrees) if any(d > 1 for _, d in degrees) else ""
    return f"meshforge_w{world_size}{tag}_r{cfg.fault_tolerance.replica_id}"


def num_groups(cfg: JobConfig) -> int:
    """fault_tolerance.group_size, or local_replicas when it is 0, or 1."""
    ft = cfg.fault_tolerance
    return ft.group_size or ft.local_replicas or 1


def data_shard(cfg: JobConfig, dp_rank: int, dp: int) -> tuple[int, int]:
    """(dp rank, dp degree) of the data loader: group g's dp rank d reads slot g x dp + d of group_size x dp."""
    if not cfg.fault_tolerance.enable:
        return dp_rank, dp
    return cfg.fault_tolerance.replica_id * dp + dp_rank, num_groups(cfg) * dp


def check_lighthouse(address: str, timeout_s: float) -> None:
    """Wait until something accepts a TCP connection at the Lighthouse's address; else one line naming it."""
    host, port = check_lighthouse_url(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"fault_tolerance.lighthouse = {address!r}: nothing answers at {host}:{port} within "
                    f"{timeout_s:g} s (comm.init_timeout_seconds); start one: meshforge ft lighthouse --port {port}"
                ) from None
            time.sleep(0.2)


def check_quorum(replica_ids: list[str], mine: str, step: int) -> None:
    """Refuse, before this group's first step, a quorum in which its replica id is taken or whose groups differ in
    size (each id carries its group size)."""
    if step > 1:
        return
    names = [r.split(":")[0] for r in replica_ids]
    ids = [n.rsplit("_r", 1)[-1] for n in names]
    layouts = sorted({n.split("_w", 1)[-1].split("_r", 1)[0] for n in names})
    sizes = sorted({layout.split("-")[0] for layout in layouts})
    my_id = mine.rsplit("_r", 1)[-1]
    if ids.count(my_id) > 1:
        raise ConfigError(
            f"fault_tolerance.replica_id = {my_id} is already used by a running replica group: give each group its "
            f"own id in [0, fault_tolerance.group_size)"
        )
    if len(sizes) > 1:
        raise ConfigError(
            f"replica groups of different sizes ({' vs '.join(sizes)} ranks) joined the same Lighthouse: every group "
            "must have the same layout (rank r of each group holds the same shards)"
        )
    if len(layouts) > 1:
        raise ConfigError(
            f"replica groups of different layouts ({' vs '.join('w' + x for x in layouts)}) joined the same "
            "Lighthouse: rank r of each group must hold the same pipeline stage and shards; give every group the same "
            "--parallelism.* degrees"
        )


class _CheckedClient:
    """The Manager's client with the quorum checked (``check_quorum``) as each result arrives."""

    def __init__(self, client: Any, name: str, step: Any) -> None:
        self._client, self._name, self._step = client, name, step

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        check_quorum(list(result.replica_ids), self._name, self._step())
        return result

    def __getattr__(self, item: str) -> Any:
        return getattr(self._client, item)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expert_biases(state: TrainState) -> list[torch.Tensor]:
    """The MoE layers' expert-bias buffers of this rank's model parts (routing state outside the parameters)."""
    return [m.expert_bias for part in state.model_parts for m in moe_layers(part) if m.expert_bias is not None]


def gradient_device(cfg: JobConfig, device: torch.device) -> torch.device:
    """Where the gradient shards the replicas all-reduce live: the host under FSDP CPU offload, else the device."""
    return torch.device("cpu") if cfg.training.enable_cpu_offload else device


def replica_process_group(device: torch.device, timeout: datetime.timedelta) -> Any:
    """torchft's cross-group process group for tensors on ``device``, chosen here only: NCCL on CUDA (the gradient
    all-reduce runs on the replicate link from device memory, with ncclCommAbort on a lost peer), XCCL on XPU, gloo
    on the host (a CPU run, or gradients on the host under CPU offload)."""
    from torchft import process_group

    if device.type == "cuda":
        return process_group.ProcessGroupNCCL(timeout=timeout)
    if device.type == "xpu":
        return process_group.ProcessGroupXCCL(timeout=timeout)
    return process_group.ProcessGroupGloo(timeout=timeout)


def params_digest(state: TrainState) -> str:
    """SHA-256 (16 hex digits) of this rank's parameter shards and MoE expert biases: what must match across groups.
    A host copy of every shard: log steps only."""
    digest = hashlib.sha256()
    tensors = [local(p.detach()) for part in state.model_parts for p in part.parameters()] + expert_biases(state)
    for t in tensors:
        digest.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().data)  # in place: no bytes copy
    return digest.hexdigest()[:16]


@dataclass
class FaultTolerance:
    """torchft around one group's training state; built by ``build`` after the model and optimizer exist."""

    cfg: JobConfig
    state: TrainState
    manager: Any = None
    name: str = ""
    retry: bool = False
    said_waiting: bool = False
    recovered: int | None = None
    position: dict[str, int] = field(default_factory=dict)
    log: Path | None = None
    started: float = field(default_factory=time.perf_counter)
    committed: float = 0.0  # when the last step committed (0: none yet)
    failures: int = 0  # attempts that failed in a row since the last commit (train/ft_clock.py)
    retried_step: int = 0  # the step whose retry was last announced (one line per step, not per retry)
    quorum_s: float = 0.0  # this step's quorum (start_quorum) and commit vote, in the ft_steps log (plan's default)
    biases: list[torch.Tensor] = field(default_factory=list)  # MoE expert biases at the step's start (a retry's)
    attempts: Path | None = None  # ft_attempts log: one row per attempted step, committed or retried

    def start(self) -> None:
        torchft = import_torchft()
        cfg, ctx = self.cfg, self.state.ctx
        check_lighthouse(cfg.fault_tolerance.lighthouse, cfg.comm.init_timeout_seconds)
        self.name = replica_name(cfg, ctx.world_size)
        store = {} if dist.is_initialized() else self._own_store()
        timeout = datetime.timedelta(seconds=cfg.comm.train_timeout_seconds)
        self.manager = torchft.Manager(
            pg=replica_process_group(gradient_device(cfg, ctx.device), timeout),
            load_state_dict=self.load_state_dict,
            state_dict=self.state_dict,
            min_replica_size=cfg.fault_tolerance.min_replica_size,
            use_async_quorum=False,  # heal at the start of the step, before the batch is read
            init_sync=False,  # every group initialises the same weights from training.seed
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=cfg.comm.init_timeout_seconds),
            connect_timeout=datetime.timedelta(seconds=cfg.comm.init_timeout_seconds),
            rank=ctx.rank,
            world_size=ctx.world_size,
            lighthouse_addr=cfg.fault_tolerance.lighthouse,
            replica_id=self.name,
            **store,
        )
        self.manager._client = _CheckedClient(self.manager._client, self.name, lambda: self.state.step)
        if cfg.fault_tolerance.start_together:  # the first commit needs every group (then min_replica_size)
            self.manager._min_replica_size = max(num_groups(cfg), cfg.fault_tolerance.min_replica_size)
        self.log = Path(cfg.job.dump_folder) / f"ft_steps.rank{ctx.rank}.jsonl"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        self.attempts = self.log.with_name(f"ft_attempts.rank{ctx.rank}.jsonl")  # every attempt, retried ones too
        self.attempts.write_text("")

    def _own_store(self) -> dict[str, Any]:
        """A one-rank group has no process group: the Manager still needs a store."""
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return {"store_addr": "127.0.0.1", "store_port": self._store.port}

    # -- the state a recovering group receives ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        params = [local(p.detach()) for part in s.model_parts for p in part.parameters()]
        optim = {
            f"{i}.{k}": local(v) if isinstance(v, torch.Tensor) else v
            for i, p in enumerate(p for part in s.model_parts for p in part.parameters())
            for k, v in s.optimizer.state.get(p, {}).items()
        }
        return {
            "params": params,
            "optimizer": optim,
            "lr_step": s.scheduler.last_epoch,
            "loader": s.loader.state_dict(),
            "step": s.step - 1,  # called at the start of step s.step: s.step - 1 are done
            "expert_bias": [b.detach().clone() for b in expert_biases(s)],  # MoE routing state (a buffer)
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        s = self.state
        params = [p for part in s.model_parts for p in part.parameters()]
        with torch.no_grad():
            for p, value in zip(params, saved["params"], strict=True):
                local(p).copy_(value)
            for i, p in enumerate(params):
                entries = {k.split(".", 1)[1]: v for k, v in saved["optimizer"].items() if k.split(".")[0] == str(i)}
                if entries:
                    s.optimizer.state[p] = {k: self._like(p, v) for k, v in entries.items()}
        position = {"last_epoch": saved["lr_step"] - 1, "_step_count": saved["lr_step"] + 1}
        s.scheduler.load_state_dict({**s.scheduler.state_dict(), **position})
        s.scheduler.step()
        s.loader.load_state_dict(saved["loader"])
        with torch.no_grad():
            for bias, value in zip(expert_biases(s), saved["expert_bias"], strict=True):
                bias.copy_(value)
        self.recovered = int(saved["step"])

    @staticmethod
    def _like(p: torch.Tensor, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.shape == () or not isinstance(p, DTensor):
            return value.clone() if isinstance(value, torch.Tensor) else value
        out = torch.zeros_like(p)
        local(out).copy_(value)
        return out

    # -- the step ---------------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """The quorum (and a live recovery when this group is behind), before the step's first batch."""
        self.retry, self.recovered = False, None
        self.position = self.state.loader.state_dict()
        self.biases = [b.detach().clone() for b in expert_biases(self.state)]
        began = time.perf_counter()
        try:
            self.manager.start_quorum()
        except ConfigError:
            raise
        except Exception as exc:
            if not self.committed:  # no quorum ever formed: nothing was lost, the Lighthouse never answered one
                report_once(self.never_formed(exc))
                raise SystemExit(NO_QUORUM_EXIT) from None
            raise SystemExit(self.lost(exc)) from None
        self.quorum_s = time.perf_counter() - began
        if self.recovered is not None:
            self.state.step = self.recovered + 1
            if self.state.metrics.console:
                print(
                    f"meshforge: fault tolerance: replica {self.cfg.fault_tolerance.replica_id} recovered step "
                    f"{self.recovered} (weights, optimizer, data position) from a live peer in "
                    f"{time.perf_counter() - began:.2f} s; continuing at step {self.state.step}",
                    flush=True,
                )

    def sync_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Average this rank's gradient shards over the quorum's replicas: one flat all-reduce."""
        grads = [local(p.grad) for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum_across(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the quorum's replica groups in place (MoE expert loads: train/moe_balance.py)."""
        self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()

    def should_commit(self) -> bool:
        """True: step the optimizer. False: the step failed somewhere (a replica died): rewind and retry."""
        waiting = self.manager._min_replica_size > self.cfg.fault_tolerance.min_replica_size
        began = time.perf_counter()
        committed = self.manager.should_commit()
        self._attempt(committed)
        if committed:
            self.manager._min_replica_size = self.cfg.fault_tolerance.min_replica_size
            self.committed, self.failures = time.perf_counter(), 0
            self._record(self.committed - began)
            return True
        self.state.optimizer.zero_grad(set_to_none=True)
        self.state.loader.load_state_dict(self.position)
        with torch.no_grad():  # the failed step's expert-bias update is undone with it
            for bias, value in zip(expert_biases(self.state), self.biases, strict=True):
                bias.copy_(value)
        self.retry, self.failures = True, self.failures + 1
        give_up_when_stuck(self, time.perf_counter(), waiting)
        if waiting:  # before the first commit: the other groups are still starting
            time.sleep(0.2)
        if self.state.metrics.console and not (waiting and self.said_waiting) and self.retried_step != self.state.step:
            self.retried_step = self.state.step
            self.said_waiting = self.said_waiting or waiting
            why = (
                f"waiting for all {num_groups(self.cfg)} replica groups (fault_tolerance.start_together)"
                if waiting
                else "a replica left the quorum"
            )
            print(f"meshforge: fault tolerance: step {self.state.step} not committed ({why}); retrying it", flush=True)
        return False

    def _attempt(self, committed: bool) -> None:
        """One row per attempted step (ft_attempts log), committed or to be retried: the lost work is counted."""
        if self.attempts is None:  # a wrapper that was not started (no log folder)
            return
        row = {"step": self.state.step, "t": time.time(), "committed": committed}
        with self.attempts.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _record(self, commit_s: float) -> None:
        """The committed step's row (ft_steps log), with the integrity digest of the parameters on log steps only when
        fault_tolerance.params_digest (off by default): it copies every local parameter shard to the host and
        SHA-256s it (8B on FSDP 8: ~4 GB per rank, seconds), which training must not pay (docs/fault-tolerance.md)."""
        assert self.log is not None
        s = self.state
        row: dict[str, Any] = {
            "step": s.step,
            "t": time.time(),
            "participants": self.manager.num_participants(),
            "samples": s.loader.sample_positions(),
            "quorum_s": round(self.quorum_s, 5),
            "commit_s": round(commit_s, 5),
        }
        digest = self.cfg.fault_tolerance.params_digest  # off by default: a host copy of every shard
        if digest and log_step(s.step, self.cfg.metrics.log_freq, self.cfg.training.steps):
            row["params_before"] = params_digest(s)
        with self.log.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def lost(self, exc: Exception) -> str:
        """The line a group that finds no quorum ends with: the last step and how to resume."""
        step = self.state.step - 1
        return (
            f"meshforge: fault tolerance: no quorum at step {step + 1} ({type(exc).__name__}: {str(exc)[:200]}): "
            f"every replica group is lost or the Lighthouse at {self.cfg.fault_tolerance.lighthouse} is gone. The last "
            f"committed step is {step}; resume by relaunching the groups (with checkpoint.enable they continue from "
            "the newest DCP checkpoint)"
        )

    def never_formed(self, exc: Exception) -> str:
        """The line a group ends with when its first quorum did not form within comm.init_timeout_seconds."""
        return (
            f"meshforge: fault tolerance: no quorum formed within comm.init_timeout_seconds = "
            f"{self.cfg.comm.init_timeout_seconds} s ({type(exc).__name__}: {str(exc)[:120]}): the Lighthouse at "
            f"{self.cfg.fault_tolerance.lighthouse} answered none; check that it is a `meshforge ft lighthouse` "
            "whose --min-replicas the running groups can meet"
        )

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def build(cfg: JobConfig, state: TrainState) -> FaultTolerance | None:
    """The fault-tolerance wrapper of this group when fault_tolerance.enable, else None."""
    if not cfg.fault_tolerance.enable:
        return None
    ft = FaultTolerance(cfg, state)
    ft.start()
    return ft


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
