"""Stack profiles (plan/accuracy/stack.py, stack_fit.py): an implementation's constants on a preset's datasheet, fitted
to only what measured runs identify, written without tomli_w, read everywhere ``--hardware`` is."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshforge.cli import main
from meshforge.config.io import ConfigError
from meshforge.plan import report, shipped
from meshforge.plan.accuracy import at_scale, folds, loo, loo_report, stack, stack_fit
from meshforge.plan.hardware import StackInfo, load_hardware
from meshforge.plan.physics.estimate import estimate

ROOT = Path(__file__).resolve().parents[2]
NEMO_ARGS = (
    "--model.flavor 8B --training.seq_len 8192 --training.local_batch_size 1 --training.gradient_accumulation_steps 32 "
    "--parallelism.data_parallel_shard_degree 4 --parallelism.context_parallel_degree 2 "
    "--parallelism.fsdp_reshard_after_forward never --gradient_sync.mode once_per_step "
    "--training.mixed_precision_reduce bfloat16 --activation_checkpoint.mode none --compile.enable"
)


@pytest.mark.parametrize("name", ["nemo-h100-bf16", "nemo-h100-fp8"])
def test_shipped_nemo_stacks_are_the_fit_of_their_rows(name: str) -> None:
    """The shipped constants are what calibrating on the one published row (two for FP8) gives, to the rounding."""
    hw = load_hardware("h100")
    obs, sources = stack_fit.read_runs(ROOT / "configs" / "stacks" / f"{name}.toml", hw)
    fitted = stack_fit.fit_stack(obs, hw, name, sources).profile
    shipped_profile = stack.load_profile(name)
    for key in shipped.STACKS[name]["efficiency"]:  # type: ignore[union-attr]
        assert getattr(shipped_profile.efficiency, key) == pytest.approx(getattr(fitted.efficiency, key), abs=2e-4), key
    assert shipped_profile.spec == hw.spec  # the datasheet is the preset's, untouched
    assert fitted.stack is not None and fitted.stack.world_sizes == (8,)
    for o in obs:  # the row is reproduced
        assert estimate(o.layout, shipped_profile).tps_per_device == pytest.approx(o.tps_per_device, rel=0.01)


def test_torchtitan_stack_is_the_shipped_h100_fit() -> None:
    assert stack.load_profile("torchtitan-h100").efficiency == load_hardware("h100").efficiency


def _runs_toml(path: Path, runs: list[tuple[int, str, float]]) -> Path:
    body = "".join(
        f'[[run]]\nname = "r{i}"\nworld_size = {w}\nargs = "{a}"\ntokens_per_s_per_device = {t}\n\n'
        for i, (w, a, t) in enumerate(runs)
    )
    path.write_text(body)
    return path


def test_one_node_runs_leave_every_inter_node_constant_at_the_hardware(tmp_path: Path) -> None:
    """Runs inside one 8-GPU node fit compute (and Float8) only: network and the links stay the preset's; a run over
    two nodes lets the fit move network. Truth: a stack 1.3x TorchTitan's compute, 1.8 Float8, 0.6 network."""
    hw = load_hardware("h100")
    truth = replace(
        hw,
        efficiency=replace(
            hw.efficiency,
            matmul=hw.efficiency.matmul * 1.3,
            attention=hw.efficiency.attention * 1.3,
            float8_speedup=1.8,
            network=0.6,
        ),
    )
    fp8 = NEMO_ARGS + " --quantize.dense.float8.enable"
    wide = NEMO_ARGS.replace("data_parallel_shard_degree 4", "data_parallel_shard_degree 8")
    wide = wide.replace("fsdp_reshard_after_forward never", "fsdp_reshard_after_forward always")

    def tps(world: int, args: str) -> float:
        obs, _ = stack_fit.read_runs(_runs_toml(tmp_path / "one.toml", [(world, args, 1.0)]), hw)
        return estimate(obs[0].layout, truth).tps_per_device

    flat = NEMO_ARGS.replace("shard_degree 4", "shard_degree 8").replace(
        "context_parallel_degree 2", "context_parallel_degree 1"
    )
    three = [(8, NEMO_ARGS, tps(8, NEMO_ARGS)), (8, fp8, tps(8, fp8)), (8, flat, tps(8, flat))]
    obs, _ = stack_fit.read_runs(_runs_toml(tmp_path / "three.toml", three), hw)
    result = stack_fit.fit_stack(obs, hw, "s")  # three runs, one node: still no network
    assert "network" in result.held and result.profile.efficiency.network == hw.efficiency.network
    one = three[:2]
    obs, _ = stack_fit.read_runs(_runs_toml(tmp_path / "node.toml", one), hw)
    result = stack_fit.fit_stack(obs, hw, "s")
    assert result.fitted == ("compute", "float8_speedup")
    assert "network" in result.held
    eff = result.profile.efficiency
    assert eff.network == hw.efficiency.network  # not identified by one node: the hardware's
    assert result.profile.spec == hw.spec
    assert eff.matmul == pytest.approx(truth.efficiency.matmul, rel=0.02)
    assert eff.float8_speedup == pytest.approx(1.8, rel=0.02)
    assert result.determines == {"r0": ("compute",), "r1": ("float8_speedup",)}
    two = [*one, (16, wide, tps(16, wide))]
    obs, _ = stack_fit.read_runs(_runs_toml(tmp_path / "two.toml", two), hw)
    result = stack_fit.fit_stack(obs, hw, "s")
    assert "network" in result.fitted
    assert result.profile.efficiency.network == pytest.approx(0.6, rel=0.1)


def test_calibrate_cli_writes_a_stack_that_plans_at_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--calibrate RUNS.toml --out s.toml writes a profile (no tomli_w involved) that --hardware reads; a prediction
    past the runs' one node carries an interval and says the inter-node constants are the hardware's."""
    runs = _runs_toml(tmp_path / "runs.toml", [(8, NEMO_ARGS, 10153.0)])
    out = tmp_path / "my-stack.toml"
    assert main(["plan", "--calibrate", str(runs), "--hardware", "h100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fitted compute" in text and "no inter-node constant is identified" in text and out.is_file()
    argv = ["plan", "--hardware", str(out), "--model.flavor", "70B", "--world-size", "64", "--json"]
    argv += ["--parallelism.tensor_parallel_degree", "8", "--activation_checkpoint.mode", "full"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tps_low"] < data["tps_per_device"] < data["tps_high"]
    assert "never measured" in data["stack_note"]
    half = math.log(data["tps_high"] / data["tps_per_device"])
    assert half >= shipped.SPLIT_LOG_SD - 1e-3  # at least the one-node -> multi-node spread


def test_stack_file_round_trip_and_bad_table(tmp_path: Path) -> None:
    profile = stack.load_profile("nemo-h100-fp8")
    path = tmp_path / "s.toml"
    stack.save(profile, path)
    assert stack.load_profile(str(path)) == profile
    path.write_text(path.read_text().replace("[stack]", "[stack]\nwhat = 1"))
    with pytest.raises(Exception, match=r"\[stack\]: unknown key 'what'"):
        stack.load_profile(str(path))


def test_nemo_rows_are_the_readme_figures() -> None:
    """8192 x GBS / step s is the README's own tokens/s (dgxc-benchmarking@35a9aecc, llama3.1/README_*.md), row by
    row: a step time paired with the wrong batch or GPU count fails."""
    readme = {
        "nemo.8b_bf16_128": 1280704,
        "nemo.8b_fp8_128": 1708474,
        "nemo.70b_bf16_64": 71235,
        "nemo.70b_bf16_2048": 2248957,
        "nemo.70b_fp8_128": 191871,
        "nemo.405b_bf16_576": 120022,
        "nemo.405b_bf16_1152": 235660,
        "nemo.405b_bf16_2304": 468646,
    }
    rows = {r.key: r for r in at_scale.NEMO_ROWS}
    for key, total in readme.items():
        # 0.5 %: the README's 70B BF16 2,048-GPU throughput is 8192 x 4096 / 14.92 s, its step column says 14.98 s
        # (the same MFU as at 1,024 GPUs); the step time, the measured figure, is what the row holds
        assert rows[key].tps_per_gpu * rows[key].world_size == pytest.approx(total, rel=0.005), key


def test_split_calibrates_on_one_node_and_ships_its_spread() -> None:
    """TorchTitan's split profile sees only its 8-GPU rows (network stays at the neutral start: one node identifies
    no inter-node constant), and shipped.SPLIT_LOG_SD is the spread of its multi-node errors."""
    profile = at_scale.split_profile()
    assert profile.stack is not None and profile.stack.world_sizes == (8,)
    assert profile.efficiency.network == loo.NEUTRAL.network
    preds = at_scale.predict_split()
    assert min(p.world_size for p in preds) >= 64
    assert at_scale.split_spread(preds) == pytest.approx(shipped.SPLIT_LOG_SD, abs=1e-3)


def test_held_out_coverage_of_a_simulated_spread_is_nominal() -> None:
    """Errors drawn N(0, 0.2) in 40 groups of 5: each group judged against the others' spread lands on 68 % (within
    3 points); errors twice as wide in one half of the groups lower the coverage of that half."""
    rng = np.random.default_rng(0)
    rows = [(f"s{g}", float(x)) for g in range(40) for x in rng.normal(0.0, 0.2, 5)]
    assert at_scale.held_out_coverage(rows)["inside"] == pytest.approx(0.683, abs=0.03)
    wide = [(g, x * (2 if int(g[1:]) % 2 else 1)) for g, x in rows]
    cov_wide = at_scale.held_out_coverage([r for r in wide if int(r[0][1:]) % 2])
    assert cov_wide["inside"] == pytest.approx(0.683, abs=0.05)  # the wide half alone: still nominal
    mixed = at_scale.held_out_coverage(wide)
    assert mixed["rows"] == 200 and mixed["sources"] == 40


def test_leave_one_source_out_leaves_the_whole_source_out() -> None:
    """Each row's leave-one-source-out prediction comes from the fit without every row of its source (recomputed for
    the two-row H200 source against the cache), and differs from its leave-one-out one where the source has twins."""
    v = folds.validation()
    assert [p.key for p in v.loso] == [p.key for p in v.loo]
    obs = loo.observations()
    groups = folds.source_groups(obs)
    cached = folds.load_or_fit(obs)[2]["tt-trainy-h200"].time.scale
    refit = folds._source_fold((obs, groups["tt-trainy-h200"]))["scale"]
    assert refit == pytest.approx(cached, rel=1e-6)
    assert "family:h200" not in refit  # no H200 row left to fit its family factor
    twins = [k for keys in groups.values() if len(keys) > 1 for k in keys]
    moved = [a.key for a, b in zip(v.loo, v.loso, strict=True) if a.key in twins and a.tps_error != b.tps_error]
    assert len(moved) == len(twins)
    cov = loo_report.honest_coverage(v)
    assert cov["loso"]["rows"] == cov["loo"]["rows"] == len(obs) and 0 < cov["loso"]["inside"] <= 1


def test_held_out_at_scale_meets_the_bars() -> None:
    """Issue 38's bars on rows never fitted: NeMo's own BF16 multi-node rows on nemo-h100-bf16 (median <= 10 %) and
    Meta's Llama 3 405B rows as the paper states them (median <= 15 %); the earlier reading (full AC on the 8K rows,
    which the paper says it did not use) is the one that misses."""
    preds = [p for p in at_scale.predict_nemo() if "bf16" in p.key]
    nemo = [p.error for p in preds]
    assert len(nemo) == 10 and at_scale._median(nemo) <= at_scale.NEMO_BAR
    # the AC is the planner's own memory verdict (issue 44.5): NeMo's published none on 9 of the 10 rows (405B on 576
    # GPUs: 79.0 GiB predicted with the fitted allocator slack, over 80 GB with the runtime reserve)
    chosen = [p.estimate.layout.ac_mode for p in preds]
    assert chosen.count(at_scale.PUBLISHED_AC) >= 9, chosen
    llama = [p.error for p in at_scale.predict_llama3()]
    assert len(llama) == 3 and at_scale._median(llama) <= at_scale.LLAMA3_BAR, llama
    assert at_scale._median([p.error for p in at_scale.predict_llama3("full")]) > at_scale.LLAMA3_BAR


def test_a_run_the_memory_model_says_cannot_fit_is_kept_and_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """405B on FSDP 8 x TP 8 of H100s ran (the runs file says so) but the planner predicts more than 80 GiB: the run
    is fitted, and one line on stderr names it, the predicted and the device's GiB, and what must be wrong."""
    args = "--model.flavor 405B --parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 8"
    runs = tmp_path / "runs.toml"
    runs.write_text(f'[[run]]\nname = "big"\nworld_size = 64\nargs = "{args}"\ntokens_per_s_per_device = 100\n')
    argv = ["plan", "--calibrate", str(runs), "--hardware", "h100", "--out", str(tmp_path / "s.toml")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: run 'big' ran, but the planner predicts"), err
    assert "GiB per device for its layout (device 80 GiB)" in lines[0] and "run's args" in lines[0]
    assert "| big |" in out  # kept: fitted and reported
    runs.write_text(
        runs.read_text()
        .replace("tensor_parallel_degree 8", "tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 8")
        .replace("world_size = 64", "world_size = 512")
    )
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # a layout that fits: no warning


def _table_rows(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return [line for line in lines[start:] if line.startswith("|")][: len(lines)]


def _cells(row: str) -> int:
    return len(row.replace("\\|", "").strip().strip("|").split("|"))


def test_calibrate_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 38's review of --calibrate's output: default run names and a name with '|' do not split the markdown
    tables' rows; the constants table names compute as the text does; calibrating on a stack names the stack whose
    constants are held; an unknown --hardware lists the shipped stacks; a stack holding nothing reads as a sentence."""
    runs = tmp_path / "runs.toml"
    runs.write_text(
        f'[[run]]\nworld_size = 8\nargs = "{NEMO_ARGS}"\ntokens_per_s_per_device = 10153\n'
        '[[run]]\nname = "a|b"\nworld_size = 8\nargs = "--model.flavor 8B"\ntokens_per_s_per_device = 9000\n'
    )
    argv = ["plan", "--calibrate", str(runs), "--hardware", "nemo-h100-fp8", "--out", str(tmp_path / "s.toml")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    constants = _table_rows(out, "| constant |")
    runs_table = _table_rows(out, "| run |")
    assert all(_cells(r) == 4 for r in constants[:3]), constants
    assert all(_cells(r) == 7 for r in runs_table[:4]), runs_table
    assert "| compute |" in out and "family:" not in out
    assert "held at nemo-h100-fp8's: float8_speedup 1.78" in out and "held at h100's" not in out
    with pytest.raises(ConfigError, match=r"a stack \(torchtitan-h100, nemo-h100-bf16, nemo-h100-fp8\)"):
        stack.load_profile("h10")
    empty = replace(stack.load_profile("nemo-h100-bf16"), stack=StackInfo("s", "h100", ("compute",), (), (8,)))
    obs = stack_fit.read_runs(runs, load_hardware("h100"))[0]
    assert obs[0].name.startswith("run 1: FSDP 4 x CP 2; lbs 1") and "|" not in obs[0].name  # a default name
    est = estimate(obs[0].layout, empty)
    est = replace(est, layout=replace(est.layout, dp_shard=32))  # 64 GPUs: past the stack's node
    note = report.stack_note(est, empty)
    assert "never measured: inter-node links are h100's (not this stack's)" in note, note


def test_guide_on_a_stack_names_it_and_its_one_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--guide --hardware STACK.toml titles guide.md with the stack's path (not the datasheet's preset) and says that
    past its one node the cells use the hardware's inter-node constants."""
    profile = tmp_path / "my-stack.toml"
    stack.save(stack.load_profile("nemo-h100-bf16"), profile)
    argv = ["plan", "--guide", "--hardware", str(profile), "--world-sizes", "8,16", "--seq-lens", "8192"]
    assert main([*argv, "--models", "8B", "--out", str(tmp_path / "g"), "--no-cache"]) == 0
    capsys.readouterr()
    text = (tmp_path / "g" / "guide.md").read_text()
    assert text.splitlines()[0] == f"# meshforge plan --guide --hardware {profile}"
    assert "Stack 'nemo-h100-bf16': fitted" in text and "the cells at 16 GPUs use h100's inter-node links" in text
    sd = max(stack.load_profile("nemo-h100-bf16").efficiency.tps_log_sd, shipped.SPLIT_LOG_SD)  # interval.tps_spread
    assert f"intervals' +-1 sd is {sd:.3f}: at least the measured one-node -> multi-node" in text
