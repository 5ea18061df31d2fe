"""Cold inductor compile time (forward + backward) of the graphs the GPU check compiles, measured on this CPU as a
floor for the GPU's (docs/benchmarks/gpu-check-budgets.md):

    OMP_NUM_THREADS=1 python scripts/gpu_check_compile.py --graph debugmodel
    OMP_NUM_THREADS=1 python scripts/gpu_check_compile.py --graph 1B --layers 2 --seq 256 --batch 1

Each graph in a fresh process with an empty inductor cache (a cold start, as on a fresh GPU machine) and one
compile thread. The block is built, checkpointed and compiled exactly as ``meshforge train`` does
(``apply_ac`` then ``apply_compile``: one compiled graph shared by the identical blocks); the step is forward,
cross-entropy and backward, under bf16 autocast when the check trains in bf16 (one process: autocast, fp32 masters).
The compile time is the first compiled step minus the second one; the eager step is printed beside it. Prints one
line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
GRAPHS = {  # the GPU check's settings (scripts/gpu_check.py): flavor, AC mode, bf16 autocast
    "debugmodel": ("debugmodel", "selective", False),  # dense_compile: fp32, seq 512, batch 8
    "1B": ("1B", "selective", True),  # mfu_1b: bf16 + compile + selective AC, seq 8192, batch 2
}


def step(model: object, tokens: object, bf16: bool) -> float:
    import torch
    import torch.nn.functional as F

    start = time.perf_counter()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ctx:
        logits = model(tokens)  # type: ignore[operator]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(0, 1))  # type: ignore[attr-defined]
    loss.backward()
    return time.perf_counter() - start


def measure(graph: str, layers: int | None, seq: int, batch: int) -> dict[str, object]:
    import torch

    from meshforge.config.schema import ActivationCheckpoint, Compile
    from meshforge.model.flavors import get_flavor
    from meshforge.model.llama import build_model
    from meshforge.parallel.activation_ckpt import apply_ac
    from meshforge.parallel.parallelize import apply_compile

    flavor, mode, bf16 = GRAPHS[graph]
    args = get_flavor(flavor)
    args = dataclasses.replace(args, n_layers=layers) if layers else args
    out: dict[str, object] = {"graph": graph, "n_layers": args.n_layers, "seq": seq, "batch": batch, "bf16": bf16}
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(args)
        apply_ac(model, ActivationCheckpoint(mode=mode))  # type: ignore[arg-type]
        if compiled:
            apply_compile(model, Compile(enable=True))
        model.to_empty(device="cpu")
        model.init_weights(0)
        first, second = step(model, tokens, bf16), step(model, tokens, bf16)
        key = "compiled" if compiled else "eager"
        out[f"{key}_first_s"], out[f"{key}_second_s"] = round(first, 2), round(second, 2)
        del model
    out["compile_s"] = round(float(out["compiled_first_s"]) - float(out["compiled_second_s"]), 1)  # type: ignore[arg-type]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graph", choices=sorted(GRAPHS), required=True)
    parser.add_argument("--layers", type=int, default=None, help="fewer blocks (they share one compiled graph)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold-inductor-")  # cold: nothing cached
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    result = measure(args.graph, args.layers, args.seq, args.batch)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["torch"] = torch.__version__
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
