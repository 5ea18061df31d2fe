"""gradient_sync.accumulate_dtype (parallel/fsdp.py ``accumulate_in``): FSDP2 with bf16 parameters and a bf16 reduce
clamps its reduce dtype to None and sums the micro-steps that skip the exchange in bf16. One process (a 1-rank gloo
group: the reduce-scatter is a copy in the reduce dtype), meshforge's apply_fsdp and set_micro_step, 8 micro-steps of
a bf16 two-block model: the step's gradient must be the fp32 sum of the 8 bf16 micro-step gradients, rounded to bf16
once for the one bf16 exchange (fp32 exactly with an fp32 reduce); the user's bfloat16 gives the bf16 running sum."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshforge.parallel.fsdp import apply_fsdp
from meshforge.parallel.gradient_sync import set_micro_step

STEPS, DIM = 8, 64


class Tiny(nn.Module):
    """Two blocks under ``layers`` (apply_fsdp shards each, then the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = torch.tanh(block(x))
        return x


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(Path(tmp_path_factory.mktemp("pg")) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(16, DIM, generator=gen) for _ in range(STEPS)]


def micro_gradients(
    init: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> dict[str, list[torch.Tensor]]:
    """Each micro-step's gradient, from a plain copy of the model in ``dtype`` (what FSDP's backward computes)."""
    plain = Tiny()
    plain.load_state_dict(init)
    plain.to(dtype)
    out: dict[str, list[torch.Tensor]] = {n: [] for n, _ in plain.named_parameters()}
    for x in batches():
        plain.zero_grad(set_to_none=True)
        (plain(x.to(dtype)).float().square().mean() / STEPS).backward()
        for n, p in plain.named_parameters():
            assert p.grad is not None and p.grad.dtype == dtype
            out[n].append(p.grad.clone())
    return out


def accumulated(
    reduce: str, accumulate: str, param: str = "bfloat16"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the FSDP step's fp32 sharded gradients, the initial weights) after STEPS micro-steps of one exchange."""
    torch.manual_seed(0)
    model = Tiny()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (1,))
    apply_fsdp(
        model,
        mesh,
        param_dtype=param,
        reduce_dtype=reduce,
        reshard_after_forward=True,
        accumulate_dtype=accumulate,
    )
    for i, x in enumerate(batches()):
        set_micro_step([model], last=i == STEPS - 1, keep=False)
        (model(x).float().square().mean() / STEPS).backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None
        grads[n] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return grads, init


def sums(micro: dict[str, list[torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The micro-step gradients summed in order in ``dtype`` (what an accumulation in ``dtype`` holds)."""
    out = {}
    for n, grads in micro.items():
        total = torch.zeros_like(grads[0], dtype=dtype)
        for g in grads:
            total += g.to(dtype)
        out[n] = total
    return out


def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> dict[str, float]:
    """Per parameter, the largest difference relative to the largest |want| where beyond ``rtol``."""
    bad = {}
    for n, w in want.items():
        err = float((got[n].float() - w.float()).abs().max() / w.float().abs().max())
        if not err <= rtol:
            bad[n] = err
    return bad


@pytest.mark.usefixtures("one_rank")
def test_bf16_reduce_sums_the_micro_steps_in_fp32_and_rounds_once() -> None:
    got, init = accumulated("bfloat16", "float32")
    want = sums(micro_gradients(init), torch.float32)
    assert all(g.dtype == torch.float32 for g in got.values())
    rounded = {n: w.to(torch.bfloat16).float() for n, w in want.items()}  # the one bf16 exchange of the fp32 sum
    assert not (bad := differ(got, rounded, 1e-6)), f"not the fp32 sum rounded to bf16 once (silent bf16 sum?): {bad}"


@pytest.mark.usefixtures("one_rank")
def test_fp32_reduce_gives_the_fp32_sum_and_bf16_accumulation_the_bf16_running_sum() -> None:
    got, init = accumulated("float32", "float32")
    micro = micro_gradients(init)
    assert not (bad := differ(got, sums(micro, torch.float32), 1e-6)), f"fp32 reduce: not the fp32 sum: {bad}"
    asked, _ = accumulated("float32", "bfloat16")  # the user's choice, an fp32 exchange of the bf16 sum
    bf16 = sums(micro, torch.bfloat16)
    assert not (bad := differ(asked, bf16, 1e-6)), f"accumulate_dtype bfloat16: not the bf16 running sum: {bad}"
    assert differ(bf16, sums(micro, torch.float32), 1e-4), "the test cannot tell a bf16 sum from an fp32 one"


@pytest.mark.usefixtures("one_rank")
def test_fp32_parameters_sum_in_fp32_under_a_bf16_reduce_whatever_is_asked() -> None:
    """FSDP's own no-sync path would down-cast fp32 parameters' gradients to a bf16 reduce dtype as they arrive."""
    for accumulate in ("float32", "bfloat16"):
        got, init = accumulated("bfloat16", accumulate, param="float32")
        fp32 = sums(micro_gradients(init, torch.float32), torch.float32)
        want = {n: w.to(torch.bfloat16).float() for n, w in fp32.items()}  # the one bf16 exchange
        assert not (bad := differ(got, want, 1e-6)), f"fp32 parameters, accumulate {accumulate}: not fp32 summed: {bad}"
