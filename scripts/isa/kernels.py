"""Which oneMKL kernels this process runs (make test-isa): "intel" when a column shard of a float32 matmul gives other
bits than the whole matmul (oneMKL's own kernels, as on an Intel Xeon), "generic" when it gives the same (oneMKL's
kernels for other CPUs, as on an AMD EPYC), and "compatible" under MKL_CBWR=COMPATIBLE."""

from __future__ import annotations

import os

import torch


def kernels() -> str:
    if os.environ.get("MKL_CBWR") == "COMPATIBLE":
        return "compatible"
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 256, generator=gen), torch.randn(96, 256, generator=gen)
    whole = x @ w.t()
    shards = torch.cat([x @ w[:48].t(), x @ w[48:].t()], dim=1)
    return "generic" if torch.equal(whole, shards) else "intel"


if __name__ == "__main__":
    print(kernels())
