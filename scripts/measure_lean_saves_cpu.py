#!/usr/bin/env python3
"""CPU time of the lean saves (model/lean.py) against torch autograd's op-by-op graph: forward + backward of one
RMSNorm and one SwiGLU gate, and one whole debugmodel training step (forward + backward), fastest of alternated repeats.

Usage (from the repository root)::

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/measure_lean_saves_cpu.py --repeats 20

Prints a Markdown table (docs/benchmarks/memory-at-scale.md). The lean pieces do the elementwise work of backward
again (the norm's normalised input, silu's sigmoid); no matmul is recomputed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshforge.model.flavors import FLAVORS
from meshforge.model.lean import rms_norm, rms_norm_reference, silu_mul
from meshforge.model.llama import build_model


def paired_ms(ref: Callable[[], None], lean: Callable[[], None], repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` runs of each, alternated so that both see the same machine load (on a shared
    host the minimum is the least disturbed run)."""
    ref(), lean()  # warm-up
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(repeats):
        for i, step in enumerate((ref, lean)):
            start = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - start)
    return 1e3 * min(times[0]), 1e3 * min(times[1])


def elementwise(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...], dtype: torch.dtype) -> Callable[[], None]:
    inputs = [torch.randn(s).to(dtype).requires_grad_() for s in shapes]

    def step() -> None:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))

    return step


def model_step(lean: bool) -> Callable[[], None]:
    args = dataclasses.replace(FLAVORS["debugmodel"], lean_saves=lean, max_seq_len=256)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    repeats = parser.parse_args().repeats
    tokens, dim, hidden = 4096, 1024, 2816
    weight_shape = (dim,)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        norm_lean = elementwise(lambda x, w: rms_norm(x, w, 1e-5), (tokens, dim), weight_shape, dtype=dtype)
        norm_ref = elementwise(lambda x, w: rms_norm_reference(x, w, 1e-5), (tokens, dim), weight_shape, dtype=dtype)
        gate_lean = elementwise(silu_mul, (tokens, hidden), (tokens, hidden), dtype=dtype)
        gate_ref = elementwise(lambda a, b: F.silu(a) * b, (tokens, hidden), (tokens, hidden), dtype=dtype)
        rows.append((f"RMSNorm {tokens}x{dim} {name}", *paired_ms(norm_ref, norm_lean, repeats)))
        rows.append((f"SwiGLU gate {tokens}x{hidden} {name}", *paired_ms(gate_ref, gate_lean, repeats)))
    rows.append(("debugmodel step 8x256 fp32", *paired_ms(model_step(False), model_step(True), repeats)))
    print("| forward + backward | autograd (ms) | lean (ms) | lean / autograd |")
    print("|---|---:|---:|---:|")
    for label, ref, lean in rows:
        print(f"| {label} | {ref:.2f} | {lean:.2f} | {lean / ref:.2f} |")


if __name__ == "__main__":
    main()
