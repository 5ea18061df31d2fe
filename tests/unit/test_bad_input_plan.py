"""Bad input to the planner's newest features (issue 36): a hardware TOML with a value of the wrong type, non-finite
or impossible (negative memory, zero efficiency, runtime above the memory), a results file with a run at 0 tokens/s,
a non-finite --ft-* figure, `--guide --models ""`: each is one line naming the key, the value and the fix, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.cli import main

PLAN = ["plan", "--model.flavor", "8B", "--world-size", "8"]
RESULTS = Path("docs/benchmarks/bench-default/sweep-c/results.json")


def one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err


HARDWARE = {
    "negative memory": ('[hardware]\nbase = "h100"\nmemory_gib = -80.0\n', "memory_gib = -80.0 is impossible"),
    "zero devices": ('[hardware]\nbase = "h100"\ndevices_per_node = 0\n', "devices_per_node = 0 is impossible"),
    "nan bandwidth": ('[hardware]\nbase = "h100"\nmemory_bandwidth = nan\n', "memory_bandwidth = nan must be a finite"),
    "inf bandwidth": ('[hardware]\nbase = "h100"\ninter_node_bandwidth = inf\n', "inter_node_bandwidth = inf must"),
    "zero peak": ('[hardware]\nbase = "h100"\npeak_bf16_flops = 0\n', "peak_bf16_flops = 0.0 is impossible"),
    "negative latency": ('[hardware]\nbase = "h100"\nintra_node_latency = -1e-6\n', "intra_node_latency = -1e-06"),
    "derate above 1": ('[hardware]\nbase = "h100"\nclock_derate = 1.5\n', "clock_derate = 1.5 is impossible"),
    "runtime above memory": ('[hardware]\nbase = "h100"\nruntime_gib = 100.0\n', "runtime_gib must be below"),
    "zero matmul": ('[hardware]\nbase = "h100"\n[efficiency]\nmatmul = 0.0\n', "matmul = 0.0 is impossible"),
    "network above 1": ('[hardware]\nbase = "h100"\n[efficiency]\nnetwork = 3.0\n', "network = 3.0 is impossible"),
    "float8 above 2": ('[hardware]\nbase = "h100"\n[efficiency]\nfloat8_speedup = 4\n', "float8_speedup = 4.0"),
    "hardware not a table": ("hardware = 5\n", "hardware = 5 must be a table"),
    "base a number": ("[hardware]\nbase = 5\n", "base = 5 must be a preset's name"),
    "misspelt table": ('[hardwre]\nbase = "h100"\n', "unknown table or key 'hardwre'"),
    "wrong type": ('[hardware]\nbase = "h100"\npeak_bf16_flops = "fast"\n', "peak_bf16_flops = 'fast' must be"),
}


@pytest.mark.parametrize("case", list(HARDWARE))
def test_a_hardware_profile_with_a_bad_value_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, says = HARDWARE[case]
    (tmp_path / "hw.toml").write_text(text)
    err = one_line([*PLAN, "--hardware", str(tmp_path / "hw.toml")], capsys)
    assert says in err and "hw.toml" in err, err


def test_every_preset_passes_the_profile_checks() -> None:
    """The bounds refuse no shipped profile (each preset's and the CPU's numbers, as a TOML would give them)."""
    import dataclasses

    from meshforge.plan.hardware import CPU_EFFICIENCY, PRESETS, _check_range, family_efficiency

    for name, spec in PRESETS.items():
        for key, value in dataclasses.asdict(spec).items():
            _check_range(key, value, f"{name} [hardware]")
        for key, value in dataclasses.asdict(family_efficiency(name)).items():
            _check_range(key, value, f"{name} [efficiency]")
    for key, value in dataclasses.asdict(CPU_EFFICIENCY).items():
        _check_range(key, value, "cpu [efficiency]")


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("tps_per_device", 0, "run 'fsdp' has tps_per_device = 0.0"),
        ("tps_per_device", float("nan"), "run 'fsdp' has tps_per_device = nan"),
        ("tps_per_device", -5, "run 'fsdp' has tps_per_device = -5.0"),
        ("peak_memory_gib", -1, "run 'fsdp' has peak_memory_gib = -1.0"),
        ("seq_len", 0, "run 'fsdp' has seq_len = 0; it must be >= 1"),
    ],
)
def test_a_results_file_with_an_impossible_run_is_one_line(
    key: str, value: float, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = json.loads(RESULTS.read_text())
    runs = runs["runs"] if isinstance(runs, dict) else runs
    assert runs[0]["name"] == "fsdp"
    runs[0][key] = value
    (tmp_path / "results.json").write_text(json.dumps(runs))
    argv = ["plan", "--calibrate", str(tmp_path / "results.json"), "--hardware", "h100", "--out", str(tmp_path / "o")]
    err = one_line(argv, capsys)
    assert says in err and "a run has a bad value (" not in err, err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--ft-mtbf-gpu-hours", "nan", "--ft-mtbf-gpu-hours nan must be a finite number > 0"),
        ("--ft-mtbf-gpu-hours", "inf", "--ft-mtbf-gpu-hours inf must be a finite number > 0"),
        ("--ft-mtbf-gpu-hours", "0", "--ft-mtbf-gpu-hours 0.0 must be a finite number > 0"),
        ("--ft-restart-seconds", "nan", "--ft-restart-seconds nan must be a finite number > 0"),
        ("--ft-checkpoint-interval-seconds", "-3", "--ft-checkpoint-interval-seconds -3.0 must be"),
        ("--ft-quorum-seconds", "inf", "--ft-quorum-seconds inf must be a finite number >= 0"),
    ],
)
def test_fault_tolerance_figures_must_be_finite(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model.flavor", "8B", "--world-size", "64", "--hardware", "h100", "--fault-tolerance"]
    argv += ["--parallelism.data_parallel_replicate_degree", "8", flag, value]
    assert says in one_line(argv, capsys)


FT_PLAN = ["plan", "--model.flavor", "8B", "--world-size", "64", "--hardware", "h100", "--fault-tolerance"]
R8 = ["--parallelism.data_parallel_replicate_degree", "8"]
FT_BAD = {  # issue 43 item 9: zero, negative, NaN, inf, out of range, failures faster than a restart, replica counts
    "mtbf negative": ([*R8, "--ft-mtbf-gpu-hours", "-5"], "--ft-mtbf-gpu-hours -5.0 must be a finite number > 0"),
    "mtbf overflows": ([*R8, "--ft-mtbf-gpu-hours", "1e308"], "--ft-mtbf-gpu-hours 1e+308 must be a finite number"),
    "failures faster than a restart": (
        [*R8, "--ft-mtbf-gpu-hours", "0.01"],
        "--ft-mtbf-gpu-hours 0.01 on 64 GPUs is one failure every 0.562 s, no longer than a restart "
        "(--ft-restart-seconds 600)",
    ),
    "a restart longer than the failures": (
        [*R8, "--ft-restart-seconds", "3e6"],  # the default MTBF on 64 GPUs: 2.85e6 s
        "one failure every 2.85e+06 s",
    ),
    "restart zero": ([*R8, "--ft-restart-seconds", "0"], "--ft-restart-seconds 0.0 must be a finite number > 0"),
    "restart negative": ([*R8, "--ft-restart-seconds", "-1"], "--ft-restart-seconds -1.0 must be a finite number > 0"),
    "restart inf": ([*R8, "--ft-restart-seconds", "inf"], "--ft-restart-seconds inf must be a finite number > 0"),
    "restart above the bound": ([*R8, "--ft-restart-seconds", "1e12"], "(at most 1e9)"),
    "save nan": ([*R8, "--ft-checkpoint-save-seconds", "nan"], "--ft-checkpoint-save-seconds nan must be a finite"),
    "save negative": ([*R8, "--ft-checkpoint-save-seconds", "-1"], "--ft-checkpoint-save-seconds -1.0 must be"),
    "interval overflows": (
        [*R8, "--ft-checkpoint-interval-seconds", "1e308"],
        "--ft-checkpoint-interval-seconds 1e+308",
    ),
    "quorum negative": ([*R8, "--ft-quorum-seconds", "-0.5"], "--ft-quorum-seconds -0.5 must be a finite number >= 0"),
    "one group": (
        ["--parallelism.data_parallel_replicate_degree", "1"],
        "set --parallelism.data_parallel_replicate_degree R (R >= 2 groups)",
    ),
    "zero groups": (["--parallelism.data_parallel_replicate_degree", "0"], "data_parallel_replicate_degree = 0 must"),
    "negative groups": (["--parallelism.data_parallel_replicate_degree", "-8"], "replicate_degree = -8 must be >= 1"),
    "groups not dividing": (["--parallelism.data_parallel_replicate_degree", "3"], "--world-size 64 is not divisible"),
    "group_size disagrees": (
        [*R8, "--fault_tolerance.group_size", "4"],
        "fault_tolerance.group_size = 4 disagrees with --parallelism.data_parallel_replicate_degree 8",
    ),
    "group_size negative": ([*R8, "--fault_tolerance.group_size", "-1"], "fault_tolerance.group_size = -1 disagrees"),
    "local_replicas disagrees": ([*R8, "--fault_tolerance.local_replicas", "3"], "local_replicas = 3 disagrees"),
    "min_replica_size zero": (
        [*R8, "--fault_tolerance.min_replica_size", "0"],
        "fault_tolerance.min_replica_size = 0 must be in [1, 8]",
    ),
    "min_replica_size above the groups": ([*R8, "--fault_tolerance.min_replica_size", "9"], "= 9 must be in [1, 8]"),
    "world size zero": (["--world-size", "0", *R8], "--world-size 0 must be >= 1"),
}


@pytest.mark.parametrize("case", list(FT_BAD))
def test_a_bad_fault_tolerance_input_is_one_line(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags, says = FT_BAD[case]
    err = one_line([*FT_PLAN, *flags], capsys)
    assert says in err, err


@pytest.mark.parametrize("flag", ["--ft-mtbf-gpu-hours", "--ft-restart-seconds", "--ft-quorum-seconds"])
def test_a_fault_tolerance_figure_without_the_section_is_one_line(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --fault-tolerance the figure would change nothing: said, not silently dropped."""
    err = one_line([*PLAN, "--hardware", "h100", flag, "5"], capsys)
    assert f"{flag} only acts with --fault-tolerance" in err, err


def test_failures_that_outrun_checkpoint_restart_are_an_answer_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    """One failure every 703 s on 64 GPUs: past a 600 s restart, but checkpoint-restart loses ~800 s per failure, so
    it makes no progress (goodput 0); the section says so instead of dividing by it."""
    assert main([*FT_PLAN, *R8, "--ft-mtbf-gpu-hours", "12.5"]) == 0
    out = capsys.readouterr().out
    assert "goodput: checkpoint-restart 0.0%" in out and "checkpoint-restart makes no progress" in out, out


@pytest.mark.parametrize(
    ("models", "says"),
    [("", "--models '' names no model"), (" , ", "--models ' , ' names no model"), ("8B,nope", "'nope' is unknown")],
)
def test_guide_models_must_name_known_flavors(models: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--guide", "--hardware", "h100", "--world-sizes", "8", "--seq-lens", "8192", "--models", models]
    assert says in one_line(argv, capsys)


NEMO = (
    "--model.flavor 8B --training.seq_len 8192 --training.local_batch_size 1 "
    "--parallelism.data_parallel_shard_degree 4 --parallelism.context_parallel_degree 2"
)
RUNS = {
    "unbalanced quote": (
        f'[[run]]\nworld_size = 8\nargs = "{NEMO} \\"unterminated"\ntokens_per_s_per_device = 10153\n',
        "runs.toml run 1: args = ",
        "cannot be split into flags (No closing quotation): fix its quoting",
    ),
    "runs not tables": ("run = [1, 2]\n", "runs.toml run 1: 1 is not a table", "write each run as a [[run]] table"),
    "degree not dividing": (
        f'[[run]]\nworld_size = 8\nargs = "{NEMO}"\ntokens_per_s_per_device = 10153\n'
        '[[run]]\nname = "tp3"\nworld_size = 8\nargs = "--model.flavor 8B --parallelism.tensor_parallel_degree 3"\n'
        "tokens_per_s_per_device = 9000\n",
        "runs.toml run 2 (tp3): world_size 8 is not divisible by tensor_parallel_degree 3",
        "fix the run's world_size or its args",
    ),
    "degrees not the world": (
        '[[run]]\nworld_size = 8\nargs = "--model.flavor 8B --parallelism.data_parallel_shard_degree 2"\n'
        "tokens_per_s_per_device = 9000\n",
        "runs.toml run 1: data_parallel_shard_degree 2 = 2, not world_size 8",
        "fix the run's world_size or its args",
    ),
    "above the peak": (
        f'[[run]]\nworld_size = 8\nargs = "{NEMO}"\ntokens_per_s_per_device = 81224\n',  # a node's figure, not a GPU's
        "runs.toml run 1: tokens_per_s_per_device = 81,224 is above 19,222",
        "at 100 % of h100's BF16 peak",
    ),
    "below the state": (
        f'[[run]]\nworld_size = 8\nargs = "{NEMO}"\ntokens_per_s_per_device = 10153\nmemory_gib = 5\n',
        "runs.toml run 1: memory_gib = 5 is below 15.0 GiB",
        "fp32 parameters, gradients and AdamW state",
    ),
}


@pytest.mark.parametrize("case", list(RUNS))
def test_a_runs_file_with_a_malformed_or_impossible_run_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 38's review: a runs file that shlex cannot split, runs that are not tables, degrees that do not divide
    the run's world_size, tokens/s above the peak's, memory below the state's: one line naming the file and the run
    (never --world-size, which a runs file does not have), exit 2."""
    text, says, fix = RUNS[case]
    (tmp_path / "runs.toml").write_text(text)
    argv = ["plan", "--calibrate", str(tmp_path / "runs.toml"), "--hardware", "h100", "--out", str(tmp_path / "o")]
    err = one_line(argv, capsys)
    assert says in err and fix in err and "--world-size" not in err, err
