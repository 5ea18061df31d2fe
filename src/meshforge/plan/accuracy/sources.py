"""Where the published rows come from: each source's repository@commit (or thread), date, what its figures measure
(plan/accuracy/published.py holds the rows)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Where rows come from: repository@commit path (or thread), date, what its figures measure."""

    key: str
    cite: str
    date: str
    measures: str


SOURCES: dict[str, Source] = {
    s.key: s
    for s in (
        Source(
            "tt-2024-12",
            "pytorch/torchtitan docs/performance.md @ d4c86e3758a8 (= benchmarks/llama3_h100_202412_torchtitan.md @ "
            "820504e20d11); torch 1963fc8, torchtitan 9dec370",
            "2024-12",
            "H100 96 GB HBM2e at 500 W, 8 per host, 400 Gb/s RDMA; tps at iteration 90; memory = max reserved GiB "
            "over GPUs",
        ),
        Source(
            "tt-2024-08",
            "pytorch/torchtitan docs/performance.md @ 3faaa1a0dee6 (unchanged through 4d88a8a44fe4)",
            "2024-08",
            "128 H100 (95 GiB HBM2e, lower TDP); tps; memory not reported",
        ),
        Source(
            "tt-asynctp-2025-06",
            "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ 2887250bbd91 (PR #1299); "
            "torch 38410cf9, torchtitan 820504e",
            "2025-06",
            "H100 96 GB (Grand Teton); average tps per GPU; memory not reported",
        ),
        Source(
            "torchao-float8",
            "pytorch/ao torchao/float8/README.md @ 8c81863ba85c (PR #1793; unchanged through 927cbfb9127a); "
            "torch 2.7.0a0+gitb98af95, torchtitan 0.0.2",
            "2025-03",
            "8x H100 (variant not stated; read as 80 GB SXM); median tps over steps 2-100; max reserved GiB",
        ),
        Source(
            "tt-trainy-h200",
            "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md @ cbccb387871a; "
            "torchtitan e7c0cae934df (llama3_8b.toml: seq 8192, selective op AC)",
            "2025-06",
            "H200 141 GB, 400 Gb/s per GPU; tps and reserved GiB at iteration 100",
        ),
        Source(
            "torchao-mx-b200",
            "pytorch/ao torchao/prototype/mx_formats/README.md, 'Training e2e benchmarks on NVIDIA B200' (quoted by "
            "pytorch/torchtitan docs/mxfp8.md @ 0d481060287f); torch 2.9.0.dev20250815+cu128, torchao "
            "0.13.0+gite4e681be6, torchtitan 6fc499f6f5b3",
            "2025-08",
            "8x power-limited B200 (one node); Llama3-8b, batch 1, seq 8192, steps 100, compile, FSDP2, per-op SAC; "
            "median tokens/s; 'Peak Memory (GB)' read as the reserved GiB log line (torchao's parse script)",
        ),
        Source(
            "tt-2024-04-a100",
            "pytorch/torchtitan docs/performance.md @ f38766edbe85 (toml: seq 8192, compile off)",
            "2024-04",
            "64 A100 80 GB; tps (WPS) per GPU; memory not reported",
        ),
    )
}
