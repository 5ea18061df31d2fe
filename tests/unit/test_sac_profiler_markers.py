"""Per-op selective AC lets profiler markers through uncounted (parallel/activation_ckpt.py): a block whose forward
emits a marker the recompute does not (FSDP's root pre-forward on a module nested in a block, the EP x TP crash of
issue 28) recomputes and matches the unwrapped block's gradients, in one process. The 4-rank proof is
tests/distributed/test_moe_parity.py::test_dp2_tp2_ep2_under_default_selective_ac_matches_single_process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from meshforge.config.schema import ActivationCheckpoint
from meshforge.parallel import activation_ckpt


class MarkedOnce(nn.Module):
    """A block whose replay emits a profiler marker its first call did not (FSDP's root pre-forward, taken in the
    recompute by the first FSDP module to run there)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.marked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.marked:
            with torch.profiler.record_function("FSDP::root_pre_forward"):
                pass  # a marker only: no computation
        self.marked = True
        return self.down(torch.relu(self.up(x)) @ torch.eye(16))


def test_per_op_sac_recomputes_a_block_whose_replay_adds_a_profiler_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    ignored = set(torch_checkpoint.SAC_IGNORED_OPS) - set(activation_ckpt.PROFILER_OPS)
    monkeypatch.setattr(torch_checkpoint, "SAC_IGNORED_OPS", ignored)  # as a fresh process has it
    torch.manual_seed(0)
    plain, x = MarkedOnce(), torch.randn(4, 8)
    plain(x).square().sum().backward()
    block = MarkedOnce()
    block.load_state_dict(plain.state_dict())
    wrapped = activation_ckpt.wrap_block(block, ActivationCheckpoint(mode="selective", selective_ac_option="op"), 0)
    try:
        wrapped(x).square().sum().backward()
    except Exception as exc:  # torch's message names the marker's invocation index
        raise AssertionError(f"per-op SAC counted a profiler marker and could not replay the forward: {exc}") from None
    for name, p in block.named_parameters():
        assert torch.equal(p.grad, dict(plain.named_parameters())[name].grad), name
