"""`meshforge ft lighthouse`: the torchft Lighthouse the replica groups form their quorum through; and the one-machine
trial `meshforge train --nproc N --fault_tolerance.enable --fault_tolerance.local_replicas R` (a Lighthouse plus R
groups of N / R ranks, each under its own torchrun, each with its own dump folder replica_<i>)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.train.fault_tolerance import import_torchft


def start_lighthouse(port: int, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> Any:
    """A LighthouseServer on 0.0.0.0:``port`` (0: a free one); its ``address()`` is what groups connect to. A port
    out of range, a count below 1 or a port in use is a one-line ConfigError naming the flag."""
    import_torchft()
    from torchft._torchft import LighthouseServer

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port: give one in 1-65535 (0: any free port)")
    limits = [("--min-replicas", min_replicas, 1), ("--join-timeout-ms", join_timeout_ms, 0)]
    for flag, value, least in [*limits, ("--heartbeat-timeout-ms", heartbeat_timeout_ms, 1)]:
        if value < least:
            raise ConfigError(f"{flag} {value} must be >= {least}")
    try:
        return LighthouseServer(
            bind=f"[::]:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=50,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except RuntimeError as exc:  # torchft's bind error, e.g. "Address already in use (os error 98)"
        raise ConfigError(f"--port {port}: the Lighthouse cannot listen there ({exc}); choose another port") from None


def lighthouse_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshforge ft lighthouse", description="run the torchft Lighthouse")
    parser.add_argument("--port", type=int, default=29510)
    parser.add_argument("--min-replicas", type=int, default=1, help="groups needed to form a quorum")
    parser.add_argument("--join-timeout-ms", type=int, default=1000, help="wait this long for late groups")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="a silent group is dead after this")
    return parser


def main(argv: list[str]) -> int:
    """`meshforge ft lighthouse [--port P] ...`: serve until interrupted."""
    if not argv or argv[0] != "lighthouse":
        raise ConfigError("usage: meshforge ft lighthouse [--port P] [--min-replicas N]")
    args = lighthouse_parser().parse_args(argv[1:])
    server = start_lighthouse(args.port, args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms)
    print(f"meshforge ft: lighthouse at {server.address()} (min replicas {args.min_replicas}); Ctrl-C stops it")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` without ``--flag VALUE`` / ``--flag=VALUE`` for each flag."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def launch_local_replicas(cfg: JobConfig, nproc: int, argv: list[str]) -> int:
    """A Lighthouse and fault_tolerance.local_replicas groups of nproc / R ranks; returns the worst exit code. A
    mistake a group would stop on is found before any starts; a group's config error or a quorum that could not
    form is named as such; only when every group was lost does one line say the last steps and how to resume.
    SIGTERM / SIGINT / SIGHUP to this launcher end every group's processes before it exits."""
    replicas = cfg.fault_tolerance.local_replicas
    if nproc % replicas:
        raise ConfigError(f"--nproc {nproc} must be a multiple of fault_tolerance.local_replicas = {replicas}")
    from meshforge.train.preflight import preflight

    preflight(cfg, nproc // replicas)  # what every group would stop on, once, before any starts
    server = start_lighthouse(0, 1, 1000, 2000)
    address = server.address()
    print(f"meshforge: fault tolerance: lighthouse at {address}; {replicas} groups of {nproc // replicas} ranks")
    rest = without(argv, "--nproc", "--fault_tolerance.local_replicas", "--job.dump_folder")
    groups: list[subprocess.Popen[bytes]] = []
    reap_on_signals(groups)
    for i in range(replicas):
        dump = str(Path(cfg.job.dump_folder) / f"replica_{i}")
        cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", str(nproc // replicas), *rest]
        cmd += ["--job.dump_folder", dump, "--fault_tolerance.replica_id", str(i)]
        cmd += ["--fault_tolerance.group_size", str(replicas), "--fault_tolerance.lighthouse", address]
        cmd += ["--fault_tolerance.local_replicas", "0"]  # a --config file's local_replicas must not launch again
        groups.append(subprocess.Popen(cmd, env=os.environ.copy()))
    while any(p.poll() is None for p in groups):  # not a blocking wait: a signal may land on a Lighthouse thread
        time.sleep(0.2)
    codes = [p.wait() for p in groups]
    server.shutdown()
    say_why(cfg, codes)
    return max(codes)


def say_why(cfg: JobConfig, codes: list[int]) -> None:
    """One line for the groups' exit codes: a config error (2) or no quorum (NO_QUORUM_EXIT) in a group is named as
    such (its own line is above); only when every group failed otherwise are they reported lost."""
    from meshforge.train.fault_tolerance import NO_QUORUM_EXIT

    replicas = len(codes)
    named = {2: "stopped on a configuration error", NO_QUORUM_EXIT: "found no quorum that could commit a step"}
    for code, what in named.items():
        if code in codes:
            print(
                f"meshforge: fault tolerance: replica group {codes.index(code)} {what} (its line is above; exit codes "
                f"{codes}): fix that and run again",
                file=sys.stderr,
            )
            return
    if all(codes):
        steps = [last_step(Path(cfg.job.dump_folder) / f"replica_{i}") for i in range(replicas)]
        print(
            f"meshforge: fault tolerance: all {replicas} replica groups lost (exit codes {codes}); last committed "
            f"steps {steps}; resume: run the same command again (with checkpoint.enable the groups continue from "
            "their newest DCP checkpoint, else from step 0)",
            file=sys.stderr,
        )


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc; torchrun puts each rank in its own session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def reap(groups: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each group's torchrun (it stops its ranks), then SIGKILL whatever of each tree is left after
    ``grace_s``: no rank outlives the launcher."""
    trees = {p.pid: descendants(p.pid) for p in groups if p.poll() is None}
    for p in groups:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in groups:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for tree in trees.values():
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for p in groups:
        p.wait()


def reap_on_signals(groups: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, SIGINT and SIGHUP reap the groups, then end this launcher with 128 + the signal."""

    def handler(signum: int, frame: Any) -> None:
        print(
            f"meshforge: fault tolerance: signal {signum}: stopping the {len(groups)} replica groups", file=sys.stderr
        )
        reap(groups)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)


def last_step(dump: Path) -> int:
    """The last step a group committed (its ft_steps log), 0 when none."""
    log = dump / "ft_steps.rank0.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return int(lines[-1].split('"step": ')[1].split(",")[0]) if lines else 0
