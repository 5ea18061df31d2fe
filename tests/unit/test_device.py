"""device/: collective tensors on the backend's device, the one peak table and CPU probe, the auto dtype, the
deterministic switches. All on a CPU: CUDA paths are exercised through a fake NCCL backend and never touch CUDA."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from meshforge.config.io import load_config
from meshforge.device import collectives, peak
from meshforge.device.determinism import enable_determinism
from meshforge.device.precision import resolve_param_dtype
from meshforge.device.transfer import to_device
from meshforge.observability.metrics import MetricsLogger
from meshforge.plan.hardware import auto_param_dtype, cpu_spec, load_hardware
from meshforge.plan.layout import layout_from_config


def fake_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)


def test_backend_devices_follow_torchs_table() -> None:
    assert collectives.backend_devices("gloo") == ["cpu", "cuda"]
    assert collectives.backend_devices("nccl") == ["cuda"]
    assert collectives.backend_devices("cpu:gloo,cuda:nccl") == ["cpu", "cuda"]
    with pytest.raises(RuntimeError, match="unknown process-group backend"):
        collectives.backend_devices("carrier-pigeon")


def test_nccl_group_gets_a_cuda_tensor_spec_without_touching_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_backend(monkeypatch, "nccl")
    assert collectives.collective_device().type == "cuda"
    fake_backend(monkeypatch, "gloo")
    assert collectives.collective_device() == torch.device("cpu")
    fake_backend(monkeypatch, "xccl")
    assert collectives.collective_device().type == "xpu"


def test_to_collective_device_keeps_tensors_the_backend_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_backend(monkeypatch, "gloo")
    t = torch.ones(2)
    assert collectives.to_collective_device(t) is t


def test_gloo_group_tensor_is_on_the_cpu(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = collectives.collective_tensor([1.5, 2.0])
        assert t.device == torch.device("cpu") and t.dtype == torch.float64
        dist.all_reduce(t)
        assert t.tolist() == [1.5, 2.0]
    finally:
        dist.destroy_process_group()


def logger(tmp_path: Path, peak_flops: float | None, from_probe: bool) -> MetricsLogger:
    return MetricsLogger(
        dump_folder=str(tmp_path),
        rank=0,
        console=True,
        flops_per_token=1e6,
        peak_flops=peak_flops,
        peak_source="test",
        non_dp_size=1,
        device=torch.device("cpu"),
        tensorboard=False,
        peak_from_probe=from_probe,
    )


def test_metrics_reduce_memory_on_the_nccl_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The old bug: a CPU float64 tensor all-reduced on the default (NCCL) group."""
    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    fake_backend(monkeypatch, "nccl")
    m = logger(tmp_path, 1e12, from_probe=False)
    m.add_tokens(100, 0.0)
    if torch.cuda.is_available():
        m.log(1, torch.tensor(1.0), torch.tensor(1.0), 1e-3)
        assert [d.type for d in seen] == ["cuda"]
    else:  # the tensor is made for CUDA, which this build lacks: it never reaches all_reduce as a CPU tensor
        with pytest.raises(AssertionError, match="CUDA"):
            m.log(1, torch.tensor(1.0), torch.tensor(1.0), 1e-3)
        assert seen == []


def test_cpu_mfu_never_exceeds_100_percent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = logger(tmp_path, 1.0, from_probe=True)  # a probe far below what any run reaches
    m.add_tokens(1000, 0.0)
    record = m.log(1, torch.tensor(1.0), torch.tensor(1.0), 1e-3)
    assert record["mfu_pct"] == pytest.approx(100.0)
    assert "above the CPU probe" in capsys.readouterr().out
    m.add_tokens(1000, 0.0)
    assert m.log(2, torch.tensor(1.0), torch.tensor(1.0), 1e-3)["mfu_pct"] <= 100.0 + 1e-9


def test_gpu_peak_is_never_bounded_by_observation(tmp_path: Path) -> None:
    m = logger(tmp_path, 1.0, from_probe=False)
    m.add_tokens(1000, 0.0)
    assert m.log(1, torch.tensor(1.0), torch.tensor(1.0), 1e-3)["mfu_pct"] > 100.0  # a datasheet peak is not moved


def test_gpu_table_matches_exact_models_only() -> None:
    assert peak.gpu_peak_bf16("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak.gpu_peak_bf16("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert peak.gpu_peak_bf16("NVIDIA H100 NVL") == pytest.approx(835e12)
    assert peak.gpu_peak_bf16("NVIDIA H200") == pytest.approx(989.4e12)
    assert peak.gpu_peak_bf16("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak.gpu_peak_bf16("NVIDIA H100") is None  # no substring guessing
    assert peak.gpu_peak_bf16("NVIDIA GeForce RTX 4090") is None


def test_unknown_gpu_reports_no_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Mystery 9000")
    value, source = peak.device_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert value is None and "NVIDIA Mystery 9000" in source and "MFU not reported" in source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak.device_peak_flops(torch.device("cuda", 0), torch.bfloat16)[0] == pytest.approx(756e12)


def test_cpu_probe_is_cached_per_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    calls: list[torch.dtype] = []
    monkeypatch.setattr(peak, "matmul_probe", lambda dtype, seconds=0.3: calls.append(dtype) or 7e9)
    assert peak.cached_cpu_peak(torch.float32, 1) == 7e9
    assert peak.cached_cpu_peak(torch.float32, 1) == 7e9
    assert calls == [torch.float32] and (tmp_path / "cpu_peak.json").is_file()


def test_matmul_probe_measures_something() -> None:
    assert peak.matmul_probe(torch.float32, size=64, seconds=0.02) > 0


def fake_probe(monkeypatch: pytest.MonkeyPatch, fp32: float, bf16: float) -> None:
    table = {torch.float32: fp32, torch.bfloat16: bf16}
    monkeypatch.setattr(peak, "cached_cpu_peak", lambda dtype, threads=None: table[dtype])


@pytest.mark.parametrize(("fp32", "bf16", "expected"), [(90e9, 1e9, "float32"), (50e9, 200e9, "bfloat16")])
def test_auto_dtype_on_cpu_is_the_faster(
    monkeypatch: pytest.MonkeyPatch, fp32: float, bf16: float, expected: str
) -> None:
    fake_probe(monkeypatch, fp32, bf16)
    name, why = resolve_param_dtype("auto", torch.device("cpu"))
    assert name == expected and "GFLOP/s" in why


def test_auto_dtype_elsewhere_and_explicit_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_probe(monkeypatch, 90e9, 1e9)
    assert resolve_param_dtype("auto", torch.device("cuda"))[0] == "bfloat16"
    assert resolve_param_dtype("bfloat16", torch.device("cpu")) == ("bfloat16", "as configured")
    assert resolve_param_dtype("float32", torch.device("cuda"))[0] == "float32"


def test_planner_cpu_profile_uses_the_training_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_probe(monkeypatch, 12e9, 3e9)
    cpu_spec.cache_clear()
    try:
        spec = cpu_spec()
        assert (spec.peak_fp32_flops, spec.peak_bf16_flops) == (12e9, 3e9)
        assert auto_param_dtype(spec) == "float32"
    finally:
        cpu_spec.cache_clear()


def test_planner_resolves_auto_without_torch_for_gpus() -> None:
    cfg = load_config(None, [])
    assert cfg.training.mixed_precision_param == "auto"
    gpu = load_hardware("h100")
    assert auto_param_dtype(gpu.spec) == "bfloat16"
    assert layout_from_config(cfg, 8).param_dtype == "bfloat16"
    assert layout_from_config(cfg, 8, auto_dtype="float32").param_dtype == "float32"


def test_deterministic_cuda_sets_cublas_workspace_and_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved: dict[str, Any] = {
        "det": torch.are_deterministic_algorithms_enabled(),
        "cudnn_det": torch.backends.cudnn.deterministic,
        "bench": torch.backends.cudnn.benchmark,
    }
    try:
        enable_determinism(torch.device("cuda"))  # only switches: no CUDA call
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        enable_determinism(torch.device("cuda"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # a valid user choice is kept
    finally:
        torch.use_deterministic_algorithms(saved["det"])
        torch.backends.cudnn.deterministic = saved["cudnn_det"]
        torch.backends.cudnn.benchmark = saved["bench"]


def test_deterministic_cpu_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = torch.are_deterministic_algorithms_enabled()
    try:
        enable_determinism(torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    finally:
        torch.use_deterministic_algorithms(saved)


def test_host_batches_stay_put_on_cpu() -> None:
    batch = torch.arange(6).view(2, 3)
    assert to_device(batch, torch.device("cpu")) is batch


class FakeBatch:
    """Records how a batch is moved (a CUDA copy cannot run on this build)."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def pin_memory(self) -> FakeBatch:
        self.calls.append("pin_memory")
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> FakeBatch:
        self.calls.append(("to", device.type, non_blocking))
        return self


def test_cuda_batches_are_pinned_and_copied_without_blocking() -> None:
    calls: list[Any] = []
    to_device(FakeBatch(calls), torch.device("cuda", 0))  # type: ignore[arg-type]
    assert calls == ["pin_memory", ("to", "cuda", True)]


def test_cuda_clock_is_read_after_one_synchronise_per_interval(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2**30)
    m = MetricsLogger(
        dump_folder=str(tmp_path),
        rank=0,
        console=False,
        flops_per_token=1e6,
        peak_flops=None,
        peak_source="test",
        non_dp_size=1,
        device=torch.device("cuda", 0),
        tensorboard=False,
    )
    from meshforge.train.loop import should_log

    cfg = load_config(None, ["--training.steps", "7", "--metrics.log_freq", "5"])
    m.start(0)
    assert events == ["sync"]  # set-up work is not the first interval's
    synced_at = []
    for step in range(1, 8):  # the metrics calls of train/loop.py's run_steps, step by step
        before = len(events)
        m.add_tokens(100, 0.01)
        m.step_done(step, cfg.training.steps)
        if should_log(step, cfg):
            record = m.log(step, torch.tensor(1.0), torch.tensor(1.0), 1e-3)
            assert record["peak_memory_gib"] == 1.0 and record["mfu_pct"] is None
        if len(events) > before:
            synced_at.append(step)
    assert synced_at == [1, 5, 7] and events.count("sync") == 4  # one per logged interval, none on other steps


def test_training_resolves_auto_once_and_keeps_explicit_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshforge.train.loop import with_param_dtype

    fake_probe(monkeypatch, 90e9, 1e9)
    cfg, banner = with_param_dtype(load_config(None, []), torch.device("cpu"))
    assert cfg.training.mixed_precision_param == "float32" and banner.startswith("float32 (auto: the faster")
    cfg, banner = with_param_dtype(
        load_config(None, ["--training.mixed_precision_param", "bfloat16"]), torch.device("cpu")
    )
    assert cfg.training.mixed_precision_param == "bfloat16" and banner == "bfloat16 (as configured)"
