"""scripts/gpu_window.py, the second GPU window, rehearsed without a GPU: its plan fits 480 s in the order of value,
its dry run validates every check's set-up, a broken set-up fails it, results are written after every check (a cut
leaves what finished), the verdicts read their references, and one real check pair (TP 2 under local ranks against
one process) runs end to end on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
OPTIONAL = {"mem_3b_selective", "mem_3b_full", "offload_1b"}
"""The checks the brief runs only if the boxes allow (the 3B's memory, activation offload): the only ones dropped."""


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gw = load("gpu_window")
gc = sys.modules["gpu_check"]


def test_the_plan_fits_480_s_in_the_order_of_value(tmp_path: Path) -> None:
    checks = gw.plan(tmp_path)
    names = [c.name for c in checks]
    assert names == list(gw.BUDGETS) and len(set(names)) == len(names)
    rows, dropped = gw.plan_rows(checks, gw.TOTAL_S)
    kept = sum(r["box_s"] for r in rows if r["kept"])
    assert gw.TOTAL_S <= 480 and kept <= gw.TOTAL_S, kept
    assert set(dropped) <= OPTIONAL, f"{dropped} dropped from {gw.TOTAL_S} s: only {sorted(OPTIONAL)} may be"
    order = [names.index(n) for n in ("env", "lr_tp2", "mem_1b_selective", "float8_1b", "peer_torchtitan")]
    assert order == sorted(order) and names.index("bench_gpu1") < min(names.index(n) for n in OPTIONAL)
    assert all(c.timeout_s >= 10 for c in checks if c.name not in gw.NOT_HERE)


def test_the_dry_run_prints_the_plan_and_validates_every_set_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = gw.main(["--dry-run", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    failed = {c["name"]: c["tail"] for c in data["checks"] if c["status"] == "failed"}
    assert not failed, failed
    assert {n for n, s in statuses.items() if s == "unsupported"} == set(gw.NOT_HERE)
    assert code == gc.EXIT_INCOMPLETE  # the peer and regather cannot run on one GPU: never 0
    assert " 1. env: box " in printed and "s of boxes kept of 480 s" in printed
    assert "| bench_gpu1 | " in (tmp_path / "results.md").read_text()


def test_a_broken_set_up_fails_the_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = {c.name: c for c in gw.plan(tmp_path)}
    stale = gw.mem_check(
        "mem_1b_selective", gw.mem_flags("1B", "selective", "cuda", ("--training.seed", "7")), tmp_path
    )
    assert gw.outcome_of(stale, "cuda", True, 100).status == "failed"  # no expectation for these flags
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / gw.BENCH).read_text().replace('recipe_name" = "rowwise"', 'recipe_name" = "blockwise"'))
    monkeypatch.setattr(gw, "BENCH", str(bad))
    outcome = gw.outcome_of(checks["bench_gpu1"], "cuda", True, 100)
    assert outcome.status == "failed" and "blockwise" in outcome.tail


def test_results_are_written_after_every_check(tmp_path: Path) -> None:
    """The second check reads the results.json the first left: a cut after it keeps the first's outcome."""
    results = tmp_path / "results.json"
    read = f"import json; d = json.load(open({str(results)!r})); assert [c['name'] for c in d['checks']] == ['a']"
    checks = [gc.Check("a", [sys.executable, "-c", "pass"], 20), gc.Check("b", [sys.executable, "-c", read], 20)]
    assert gw.run(checks, tmp_path, budget_s=100, device="cpu", dry=False) == 0
    assert [c["status"] for c in json.loads(results.read_text())["checks"]] == ["ok", "ok"]
    assert (tmp_path / "logs" / "b.log").is_file()  # the logs beside the results: they come back from the device


def test_the_verdicts_read_their_references() -> None:
    out = {n: gc.Outcome(n, "ok", 1.0, {"losses": [2.0, 1.5], "grad_norms": [1.0, 0.9]}) for n in ("lr_dense_ref",)}
    out["lr_tp2"] = gc.Outcome("lr_tp2", "ok", 1.0, {"losses": [2.0, 1.5001], "grad_norms": [1.0, 0.9]})
    out["lr_ep2"] = gc.Outcome("lr_ep2", "failed", 1.0, {}, "ConfigError: --local-ranks 2 needs torch's local tensors")
    verdict = gw.judge.judge_local(out, "cpu")
    assert out["lr_tp2"].status == "wrong" and verdict["lr_tp2_losses_max_rel_diff"] > 1e-5
    assert gw.judge.judge_local(out, "cpu") == verdict  # the verdict is recomputed after every check: the same
    assert out["lr_ep2"].status == "unsupported"
    mem = {"mem_1b_full": gc.Outcome("mem_1b_full", "ok", 1.0, {"max_memory_allocated_gib": 30.0})}
    mem["mem_1b_full"].details["max_memory_reserved_gib"] = 32.0
    rows = gw.judge.judge_memory(mem, {"mem_1b_full": {"exact_peak_gib": 29.0, "planner_peak_gib": 31.0}})["memory"]
    assert rows["mem_1b_full"]["allocated_minus_exact_gib"] == 1.0
    assert rows["mem_1b_full"]["reserved_minus_allocated_gib"] == 2.0
    assert rows["mem_1b_full"]["planner_minus_reserved_gib"] == -1.0


def test_float8_losses_past_2_percent_of_bf16_are_wrong(tmp_path: Path) -> None:
    def record(name: str, tps: float, losses: list[float]) -> dict[str, object]:
        return {"name": name, "status": "ok", "tps_per_device": tps, "loss_curve": list(enumerate(losses, 1))}

    runs = [record("compile", 100.0, [12.0, 11.0, 10.0]), record("compile_float8_tensorwise", 130.0, [12.0, 11.1, 10])]
    runs.append(record("compile_float8_rowwise", 120.0, [12.0, 11.5, 10.0]))  # 4.5 % off at step 2
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    outcomes = {"float8_1b": gc.Outcome("float8_1b", "ok", 1.0)}
    verdict = gw.judge.judge_bench(outcomes, tmp_path)
    assert verdict["compile_float8_tensorwise"]["speedup_over_bf16"] == 1.3
    assert outcomes["float8_1b"].status == "wrong" and "rowwise" in outcomes["float8_1b"].tail


def test_the_cpu_rehearsal_runs_tensor_parallel_under_local_ranks_against_one_process(tmp_path: Path) -> None:
    """A real check pair end to end on the CPU: debugmodel (2 layers, seq 64, 2 steps) in one process and as TP 2
    under --local-ranks 2, judged by the window's parity verdict."""
    pytest.importorskip("torch.distributed._local_tensor")
    argv = ["--device", "cpu", "--only", "env", "lr_dense_ref", "lr_tp2", "--out", str(tmp_path)]
    assert gw.main([*argv, "--work", str(tmp_path / "runs")]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert {c["name"]: c["status"] for c in data["checks"]} == {"env": "ok", "lr_dense_ref": "ok", "lr_tp2": "ok"}
    assert data["verdict"]["lr_tp2_losses_max_rel_diff"] <= 1e-5
