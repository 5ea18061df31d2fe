"""`meshforge ft lighthouse`: the torchft Lighthouse the replica groups form their quorum through; and the one-machine
trial `meshforge train --nproc N --fault_tolerance.enable --fault_tolerance.local_replicas R` (a Lighthouse plus R
groups of N / R ranks, each under its own torchrun, each with its own dump folder replica_<i>)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.train.fault_tolerance import import_torchft


def start_lighthouse(port: int, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> Any:
    """A LighthouseServer on 0.0.0.0:``port`` (0: a free one); its ``address()`` is what groups connect to."""
    import_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


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
    """A Lighthouse and fault_tolerance.local_replicas groups of nproc / R ranks; returns the worst exit code. When
    every group has failed, one line says the last step each committed and how to resume."""
    replicas = cfg.fault_tolerance.local_replicas
    if nproc % replicas:
        raise ConfigError(f"--nproc {nproc} must be a multiple of fault_tolerance.local_replicas = {replicas}")
    server = start_lighthouse(0, 1, 1000, 2000)
    address = server.address()
    print(f"meshforge: fault tolerance: lighthouse at {address}; {replicas} groups of {nproc // replicas} ranks")
    rest = without(argv, "--nproc", "--fault_tolerance.local_replicas", "--job.dump_folder")
    groups = []
    for i in range(replicas):
        dump = str(Path(cfg.job.dump_folder) / f"replica_{i}")
        cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", str(nproc // replicas), *rest]
        cmd += ["--job.dump_folder", dump, "--fault_tolerance.replica_id", str(i)]
        cmd += ["--fault_tolerance.group_size", str(replicas), "--fault_tolerance.lighthouse", address]
        groups.append(subprocess.Popen(cmd, env=os.environ.copy()))
    codes = [p.wait() for p in groups]
    server.shutdown()
    if all(codes):
        steps = [last_step(Path(cfg.job.dump_folder) / f"replica_{i}") for i in range(replicas)]
        print(
            f"meshforge: fault tolerance: all {replicas} replica groups lost (exit codes {codes}); last committed "
            f"steps {steps}; resume: run the same command again (with checkpoint.enable the groups continue from "
            "their newest DCP checkpoint, else from step 0)",
            file=sys.stderr,
        )
    return max(codes)


def last_step(dump: Path) -> int:
    """The last step a group committed (its ft_steps log), 0 when none."""
    log = dump / "ft_steps.rank0.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return int(lines[-1].split('"step": ')[1].split(",")[0]) if lines else 0
