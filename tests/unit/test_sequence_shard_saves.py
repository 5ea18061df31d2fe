"""parallel/sequence_shard_saves.py under autocast: a run without FSDP in bf16 computes under autocast
(device/precision.py), and the function's backward runs outside it; it once crashed there (TP 2 without FSDP in bf16:
"expected m1 and m2 to have the same dtype, BFloat16 != float"). One rank over torch's fake process group (its
all-gather and reduce-scatter of one rank are the identity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshforge.parallel.sequence_shard_saves import _GatheredLinears
from meshforge.tools.dry_run import fake_world


def test_gathered_linears_under_autocast_match_autocast_linears() -> None:
    torch.manual_seed(0)
    shard = torch.randn(2, 8, 16, requires_grad=True)
    weights = [torch.randn(24, 16, requires_grad=True), torch.randn(12, 16, requires_grad=True)]
    with fake_world(1):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = _GatheredLinears.apply(shard, mesh, *weights)
        sum(o.float().sum() for o in outs).backward()
    got = [shard.grad, *(w.grad for w in weights)]
    assert [o.dtype for o in outs] == [torch.bfloat16] * 2
    assert [g.dtype for g in got] == [torch.float32] * 3  # each gradient in its input's dtype

    ref = [t.detach().clone().requires_grad_() for t in (shard, *weights)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_outs = [F.linear(ref[0], w) for w in ref[1:]]
    sum(o.float().sum() for o in ref_outs).backward()
    for o, r in zip(outs, ref_outs, strict=True):
        assert torch.equal(o, r)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r.grad, rtol=2e-2, atol=2e-2)
