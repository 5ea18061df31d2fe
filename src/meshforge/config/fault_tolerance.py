"""The [fault_tolerance] section (train/fault_tolerance.py), in its own module: schema.py is at its size limit."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from meshforge.errors import ConfigError


@dataclass
class FaultTolerance:
    """Fault-tolerant replica groups on torchft (train/fault_tolerance.py; TorchTitan's key names)."""

    enable: bool = False
    """Run this job as one replica group of HSDP's replicate dimension under torchft (needs meshforge[ft])."""
    replica_id: int = 0
    """This group's id in [0, group_size)."""
    group_size: int = 0
    """Number of replica groups (the data is split over group_size x dp); 0: local_replicas, else 1."""
    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft Lighthouse (`meshforge ft lighthouse`)."""
    min_replica_size: int = 1
    """Commit a step only when at least this many groups took part."""
    start_together: bool = True
    """The first step waits for all group_size groups (else a group that starts later begins with a recovery)."""
    local_replicas: int = 0
    """With `meshforge train --nproc N`: start a Lighthouse and this many local groups of N / local_replicas ranks."""
    max_failed_attempts: int = 3
    """Give up (exit 5) only after this many attempts of a step failed in a row and comm.train_timeout_seconds have
    passed since the last commit (both restart at each commit); >= 2: the first attempt after a hung peer always
    fails (it waits out the timeout), the retry is the one that runs in the smaller quorum."""
    params_digest: bool = False
    """Hash this rank's parameter shards into ft_steps on log steps (a host copy of every shard: tests, debugging)."""

    def validate(self) -> None:
        if not self.enable:
            return
        for key in ("local_replicas", "group_size"):  # each reported as itself, before the values derived from it
            if getattr(self, key) < 0:
                raise ConfigError(f"fault_tolerance.{key} = {getattr(self, key)} must be >= 0 (0: not set)")
        groups = self.group_size or self.local_replicas or 1
        if not 0 <= self.replica_id < groups:
            raise ConfigError(
                f"fault_tolerance.replica_id = {self.replica_id} must be in [0, fault_tolerance.group_size = {groups})"
            )
        if self.max_failed_attempts < 2:
            raise ConfigError(
                f"fault_tolerance.max_failed_attempts = {self.max_failed_attempts} must be >= 2: the first attempt "
                "after a hung peer always fails (it waits out comm.train_timeout_seconds); the retry runs in the "
                "smaller quorum"
            )
        if self.min_replica_size < 1:
            raise ConfigError(f"fault_tolerance.min_replica_size = {self.min_replica_size} must be >= 1")
        if self.min_replica_size > groups:  # no quorum could ever commit a step: the groups would retry forever
            key = "group_size" if self.group_size else "local_replicas" if self.local_replicas else "group_size"
            raise ConfigError(
                f"fault_tolerance.min_replica_size = {self.min_replica_size} exceeds the {groups} replica group(s) "
                f"(fault_tolerance.{key} = {getattr(self, key) or 1}): no quorum could commit a step; set it to at "
                f"most {groups}"
            )
        check_lighthouse_url(self.lighthouse)


def check_lighthouse_url(address: str, key: str = "fault_tolerance.lighthouse") -> tuple[str, int]:
    """(host, port) of a Lighthouse address (``http://host:port``; 29510 when the port is left out), or a one-line
    ConfigError naming ``key``, the value and the expected form."""
    url = urlparse(address if "://" in address else f"http://{address}")
    fix = "give it as http://HOST:PORT with a port in 1-65535, e.g. http://127.0.0.1:29510"
    try:
        port = 29510 if url.port is None else url.port
    except ValueError:  # a port out of range or not a number
        port = 0
    if not 1 <= port <= 65535:
        raise ConfigError(f"{key} = {address!r} has no valid port: {fix}")
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"{key} = {address!r} is not an address: {fix}")
    return url.hostname, port
