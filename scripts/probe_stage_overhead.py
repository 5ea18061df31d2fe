"""How much host time a pipeline action costs besides its work: one full backward of two blocks against torch's split
backward (input gradients, then weight gradients, as zero-bubble schedules run it), for a few sizes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/probe_stage_overhead.py

The split does the same FLOPs in two autograd passes; what it costs more is the per-pass overhead the planner's
``HardwareSpec.stage_overhead`` stands for (docs/planner.md, "Hardware"; docs/benchmarks/planner-calibration-cpu.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshforge.model.flavors import get_flavor
from meshforge.model.llama import Transformer


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def probe(flavor: str, seq: int, repeats: int = 40) -> tuple[float, float]:
    """Median milliseconds of forward + full backward of two blocks, and the median extra of a split backward, timed
    alternately so that load on the host hits both alike."""
    args = get_flavor(flavor).with_seq_len(seq)
    model = Transformer(args)
    model.init_weights(0)
    blocks = torch.nn.ModuleList(list(model.layers.values())[:2])
    rope, x0 = model.rope[:seq], torch.randn(1, seq, args.dim)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x, rope)
        return x

    def full() -> None:
        y = forward(x0.clone().requires_grad_())
        y.backward(torch.ones_like(y))

    def split() -> None:
        x = x0.clone().requires_grad_()
        y = forward(x)
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], blocks.parameters())
        stage_backward_weight(blocks.parameters(), groups)

    full(), split()
    pairs = [(timed(full), timed(split)) for _ in range(repeats)]
    return statistics.median(f for f, _ in pairs), statistics.median(s - f for f, s in pairs)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print("| flavor | seq | forward + full backward ms | split backward costs more, ms |")
    print("|---|---:|---:|---:|")
    for flavor, seq in (("debugmodel", 128), ("debugmodel", 512), ("100m", 128), ("100m", 512)):
        step, extra = probe(flavor, seq)
        print(f"| {flavor} | {seq} | {step:.2f} | {extra:+.2f} |")


if __name__ == "__main__":
    main()
