"""Qwen3's per-head q/k RMSNorm (head_dim 32 != dim / heads = 16) and Qwen2's q/k/v biases under tensor parallel
against one process, from tiny Hugging Face config.json fixtures (fp32): Qwen3's losses and gradient norms within 1e-5
relative for 3 steps, both models' gradients parameter by parameter, and a TP 2 import of HF weights. Under TP the
norms act on each rank's own heads with replicated weights (their gradients summed over the ranks' heads), the biases
are split with their projections' rows."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import GLOBAL_BATCH, assert_parity, train_records

pytestmark = pytest.mark.distributed
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"


def run(world: int, model: str, overrides: list[str]) -> list[tuple[float, float]]:
    hf = ["--model.hf_config", str(FIXTURES / model), "--training.steps", "3"]
    records = run_ranks(train_records, world, [*hf, *overrides])[0]
    return [(r["loss"], r["grad_norm"]) for r in records]


@functools.cache
def reference(model: str) -> tuple[tuple[float, float], ...]:
    return tuple(run(1, model, ["--training.local_batch_size", str(GLOBAL_BATCH)]))


def check(got: list[tuple[float, float]], model: str) -> None:
    want = reference(model)
    assert_parity([g[0] for g in got], [w[0] for w in want])
    assert_parity([g[1] for g in got], [w[1] for w in want])


@pytest.mark.parametrize(("model", "sequence_parallel"), [("qwen3_tiny", "true"), ("qwen3_tiny", "false")])
def test_tp2_matches_single_process(model: str, sequence_parallel: str) -> None:
    layout = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", sequence_parallel]
    check(run(2, model, ["--training.local_batch_size", str(GLOBAL_BATCH), *layout]), model)


def test_tp2_hf_import_of_the_extras_equals_one_process(tmp_path: Path) -> None:
    """TP-sharded q/k/v biases (each rank reads the whole heads around its rows, then permutes) and replicated q/k
    norm weights load from Hugging Face files into a TP 2 model exactly as one process loads them."""
    from dataclasses import replace

    import numpy as np
    import torch
    from test_hf_sharded_import import import_weights

    from meshforge.checkpoint import hf as hf_interop
    from meshforge.model.hf_config import args_from_hf, read_hf_config
    from meshforge.model.llama import build_model

    args = replace(args_from_hf(read_hf_config(str(FIXTURES / "qwen3_tiny"))), qkv_bias=True).with_seq_len(64)
    model = build_model(args)  # both extras: Qwen3 with attention_bias
    model.to_empty(device="cpu")
    model.init_weights(11)
    with torch.no_grad():  # init leaves biases at zero and norms at one: make their entries differ
        for name, p in model.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    hf_dir = tmp_path / "hf"  # its config.json (Qwen3ForCausalLM, attention_bias) is the run's model.hf_config
    hf_interop.save_hf({k: v.detach() for k, v in model.state_dict().items()}, args, hf_dir, dtype="float32")
    want = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    overrides = ["--model.hf_config", str(hf_dir), "--parallelism.tensor_parallel_degree", "2"]
    for weights, counts in run_ranks(import_weights, 2, str(hf_dir), overrides):
        assert weights.keys() == want.keys()
        assert all(np.array_equal(weights[k], want[k]) for k in want), [
            k for k in want if not np.array_equal(weights[k], want[k])
        ]
        assert counts["get_slice"] > 0


def gradients(model: str, tp: int) -> dict[str, Any]:
    """Runs inside a rank: one forward and backward of the fixture model (sequence parallel under TP) on fixed tokens;
    every parameter's full gradient as the optimizer sees it (DTensor placements resolved to the parameter's)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshforge.model.hf_config import args_from_hf, read_hf_config
    from meshforge.model.llama import build_model
    from meshforge.parallel.tensor_parallel import apply_tp

    net = build_model(args_from_hf(read_hf_config(str(FIXTURES / model))).with_seq_len(64))
    if tp > 1:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        apply_tp(net, mesh, sequence_parallel=True, loss_parallel=False, float8=False, async_tp=False)
    net.to_empty(device="cpu")
    net.init_weights(0)
    tokens = torch.randint(0, 2048, (4, 65), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    out = {}
    for name, p in net.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):  # a Partial gradient is reduced where it meets the (Replicate / Shard) parameter
            grad = grad.redistribute(placements=p.placements).full_tensor()  # type: ignore[union-attr]
        out[name] = grad.detach().numpy().copy()  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("model", ["qwen3_tiny", "qwen2_tiny"])
def test_tp2_gradients_equal_one_process(model: str) -> None:
    """Adam's first steps hardly see a q/k norm gradient left unreduced over the ranks' heads (the update is about
    lr x its sign): the gradients themselves are compared, each norm weight's and bias's by name."""
    import numpy as np

    want = run_ranks(gradients, 1, model, 1)[0]
    got = run_ranks(gradients, 2, model, 2)[0]
    assert got.keys() == want.keys()
    assert any(k.endswith(("q_norm.weight", ".bias")) for k in want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-8, err_msg=name)
