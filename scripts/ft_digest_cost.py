"""What the fault-tolerance integrity digest (train/fault_tolerance.py ``params_digest``, on log steps when
fault_tolerance.params_digest) costs per call on this machine: a model flavor's parameters (fp32, on the CPU, one
process: the shard of a rank holding the whole model), the median of REPEATS calls, and the throughput in GB/s
that scales it to a rank's shard at any size. docs/fault-tolerance.md quotes it.

    PYTHONPATH=src python scripts/ft_digest_cost.py [FLAVOR] [REPEATS]     # default 100m, 5
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from meshforge.model.flavors import get_flavor
from meshforge.model.llama import Transformer
from meshforge.train.fault_tolerance import params_digest


def main(flavor: str = "100m", repeats: int = 5) -> dict[str, float | str]:
    torch.manual_seed(0)
    model = Transformer(get_flavor(flavor))  # real storage: the digest reads every byte
    state = SimpleNamespace(model_parts=[model])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        params_digest(state)  # type: ignore[arg-type]
        times.append(time.perf_counter() - began)
    median = statistics.median(times)
    return {
        "flavor": flavor,
        "parameter_bytes": nbytes,
        "digest_s_median": round(median, 4),
        "digest_s_min": round(min(times), 4),
        "gb_per_s": round(nbytes / median / 1e9, 3),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0] if args else "100m", int(args[1]) if len(args) > 1 else 5)))
