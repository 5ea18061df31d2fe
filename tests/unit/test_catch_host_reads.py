"""The host-read counter (device/host_reads.py) on its own, in one process (issue 43 item 8: a module with no unit
test; tests/distributed/test_host_reads.py uses it over whole training runs, where a counter that misses a kind of
read just reports fewer reads). Every kind of read it names is recorded, with its op; what is not a read is not; the
call site is the innermost meshforge line, the library line beside it."""

from __future__ import annotations

import re

import torch

from meshforge.device import host_reads
from meshforge.device.host_reads import HostReads
from meshforge.model.moe import GroupedExperts

SCALAR = "_local_scalar_dense"


def ops(run: object) -> list[str]:
    with HostReads() as reads:
        run()  # type: ignore[operator]
    return [r.op for r in reads.reads]


def test_every_kind_of_read_is_recorded_with_its_op() -> None:
    t, mask = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([True, False, True])
    one = torch.tensor(3.0)
    assert ops(lambda: one.item()) == [SCALAR]
    assert ops(lambda: (float(one), int(one), bool(one))) == [SCALAR] * 3
    assert ops(lambda: 1 if one > 2 else 0) == [SCALAR]  # an `if tensor:`
    assert ops(lambda: f"{one:.2f}") == [SCALAR]  # a format
    assert ops(lambda: t.tolist()) == ["Tensor.tolist()"]
    assert ops(lambda: t.numpy()) == ["Tensor.numpy()"]
    assert ops(lambda: t.cpu()) == ["Tensor.cpu()"]
    assert ops(lambda: t.to("cpu")) == ["Tensor.to()"]
    assert ops(lambda: t.to(device="cpu")) == ["Tensor.to()"]
    sized = "(output size from the data)"
    assert ops(lambda: t.nonzero()) == [f"nonzero {sized}"]
    assert ops(lambda: t.masked_select(mask)) == [f"masked_select {sized}"]
    assert ops(lambda: torch.unique(t)) == [f"_unique2 {sized}"]
    assert ops(lambda: torch.unique_consecutive(t)) == [f"unique_consecutive {sized}"]
    assert ops(lambda: torch.repeat_interleave(t, torch.tensor([1, 2, 1]))) == [f"repeat_interleave {sized}"]


def test_what_is_not_a_read_is_not_recorded() -> None:
    """Device work, a dtype cast, the compute device as a torch.device (cannot be told from the host on a CPU run),
    repeat_interleave given its output size, a host-to-host copy: nothing."""
    t = torch.tensor([1.0, 0.0, 2.0])

    def work() -> None:
        u = (t * 2 + 1).sum() / t.numel()
        t.to(torch.float64)
        t.to(torch.device("cpu"))
        t.to(device=torch.device("cpu"))
        t.to(t.device, torch.float16)
        torch.repeat_interleave(t, torch.tensor([1, 2, 1]), output_size=4)
        torch.empty(3).copy_(t)
        torch.where(t > 0, t, u)

    assert ops(work) == []


def test_a_copy_counts_only_from_an_accelerator_to_the_host() -> None:
    """A download: copy_ into a host tensor from a device one, or _to_copy of a device tensor to device="cpu" (the
    meta device stands for an accelerator: never true between two host tensors)."""
    host, dev = torch.empty(2), torch.empty(2, device="meta")
    copy, to_copy = torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default
    assert host_reads._is_download(copy, (host, dev), {})
    assert not host_reads._is_download(copy, (dev, host), {})  # an upload
    assert not host_reads._is_download(copy, (host, torch.empty(2)), {})
    assert host_reads._is_download(to_copy, (dev,), {"device": torch.device("cpu")})
    assert not host_reads._is_download(to_copy, (dev,), {"dtype": torch.float16})  # a cast on the device
    assert not host_reads._is_download(to_copy, (host,), {"device": "cpu"})


def test_the_site_is_the_innermost_meshforge_line_and_the_report_counts() -> None:
    """A read inside meshforge (the experts' loop path reads its group sizes: model/moe.py swiglu_loop, called by
    GroupedExperts.forward) names swiglu_loop's line, not its caller's; a read from outside meshforge names its own
    line as the origin; the report counts each distinct read; nothing is recorded after the block."""
    experts = GroupedExperts(dim=4, hidden_dim=8, n_experts=2)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w)
    experts.use_grouped_mm = False
    x, counts = torch.randn(5, 4), torch.tensor([2, 3])
    with HostReads() as reads:
        experts(x, counts)
        experts(x, counts)
        torch.unique(counts)
    counts.tolist()  # after the block
    assert len(reads.reads) == 3
    first, _, outside = reads.reads
    assert first.op == "Tensor.tolist()" and re.fullmatch(r"meshforge/model/moe\.py:\d+ swiglu_loop", first.site)
    assert first.origin == first.site and str(first) == f"Tensor.tolist() at {first.site}"
    assert outside.site == "(outside meshforge)" and "torch/functional.py" in outside.origin
    assert reads.report().splitlines() == [f"2 x {first}", f"1 x {outside}"]
    assert HostReads().report() == "no host reads"
