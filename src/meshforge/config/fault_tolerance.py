"""The [fault_tolerance] section (train/fault_tolerance.py), in its own module: schema.py is at its size limit."""

from __future__ import annotations

from dataclasses import dataclass

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

    def validate(self) -> None:
        if not self.enable:
            return
        groups = self.group_size or self.local_replicas or 1
        if not 0 <= self.replica_id < groups:
            raise ConfigError(
                f"fault_tolerance.replica_id = {self.replica_id} must be in [0, fault_tolerance.group_size = {groups})"
            )
        if self.min_replica_size < 1:
            raise ConfigError(f"fault_tolerance.min_replica_size = {self.min_replica_size} must be >= 1")
        if self.local_replicas < 0 or self.group_size < 0:
            raise ConfigError("fault_tolerance.local_replicas and fault_tolerance.group_size must be >= 0")
