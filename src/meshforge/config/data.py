"""The [data] section (data/shards.py: reading prepared shards), in its own module: schema.py is at its size limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshforge.errors import ConfigError


@dataclass
class Data:
    """Reading prepared token shards (`meshforge data prepare`)."""

    max_open_shards: int = 32
    """Memory maps of shards (and as many of their .idx) kept open per split; more are closed least recently used."""
    verify: Literal["cheap", "full", "sizes"] = "cheap"
    """At start-up check every shard's sizes, .idx headers and ends; cheap: then each shard's sha256 on a reader thread
    before its first read (off the step's path); full: every sha256 at start-up; sizes: no sha256."""

    def validate(self) -> None:
        if self.max_open_shards < 2:
            raise ConfigError(f"data.max_open_shards = {self.max_open_shards} must be >= 2")
