"""Chunked loss on this CPU: tracked tensor peak, peak RSS and step time of one process, chunked vs full logits.

    PYTHONPATH=src python scripts/measure_loss_chunks_cpu.py CHUNKS   # one configuration per process (clean RSS)

A 2-block `tiny` with a 32,768-token vocabulary, seq 512, batch 4, fp32 (the loss dominates memory, as at 8B)."""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model


def main(chunks: int) -> dict[str, float]:
    torch.manual_seed(0)
    args = dataclasses.replace(get_flavor("tiny"), n_layers=2, vocab_size=32768)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.loss_chunks = chunks
    tokens, labels = torch.randint(0, 32768, (4, 512)), torch.randint(0, 32768, (4, 512))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if chunks > 1:
            loss = model(tokens, None, labels)
        else:
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()

    step()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    peak = sum(v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items() if k != "Total")
    start = time.perf_counter()
    for _ in range(5):
        step()
    return {
        "chunks": chunks,
        "tracked_peak_mib": round(peak / 2**20, 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "step_s": round((time.perf_counter() - start) / 5, 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
