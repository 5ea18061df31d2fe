"""The composability table (parallel/composability.py): its refusals reach training's checks, its evidence exists,
and docs/composability.md is generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.config.schema import Float8, Parallelism
from meshforge.errors import ConfigError
from meshforge.parallel import composability as table
from meshforge.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


def test_doc_is_generated_from_the_table() -> None:
    assert (ROOT / "docs" / "composability.md").read_text() == table.render_markdown(), (
        "docs/composability.md is stale: run python -m meshforge.parallel.composability"
    )


def test_every_cited_test_exists() -> None:
    for (p, f), c in table.CELLS.items():
        table.cell(p, f)  # known names
        if c.status == "refused":
            assert c.evidence and c.alternative, (p, f)
            continue
        path, _, name = c.evidence.partition("::")
        text = (ROOT / path).read_text()
        assert not name or f"def {name}(" in text, c.evidence


def test_zero_bubble_schedules_refuse_default_ac_with_the_fix() -> None:
    error = table.refusal(["fsdp", "pp_ZBVZeroBubble"], ["ac_selective_op"])
    assert isinstance(error, ConfigError) and "selective_ac_option = 2" in str(error)
    assert table.refusal(["fsdp", "pp_ZBVZeroBubble"], ["ac_every_n"]) is None
    assert table.refusal(["pp_1F1B"], ["ac_selective_op"]) is None


def test_validate_features_reads_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1)
    args = dict(device=torch.device("cpu"), compile_enabled=True, float8=Float8())
    dims.validate_features(Parallelism(), **args)  # type: ignore[arg-type]  # FSDP + compile: parity-tested
    monkeypatch.setitem(table.CELLS, ("fsdp", "compile"), table.Cell("refused", "planted", "compile.enable = false"))
    with pytest.raises(ConfigError, match="planted"):
        dims.validate_features(Parallelism(), **args)  # type: ignore[arg-type]


def test_counts_cover_every_cell() -> None:
    assert sum(table.counts().values()) == len(table.PARALLELISMS) * len(table.FEATURES)


def test_bench_matrix_cannot_name_a_refused_combination() -> None:
    import tomllib

    from meshforge.bench.matrix import parse_matrix

    tree = tomllib.loads((ROOT / "configs" / "bench" / "default.toml").read_text())
    parse_matrix(tree)  # the shipped preset names no refused cell
    tree["bench"]["ac_mode"] = "selective"  # per-op by default: refused with the zero-bubble run
    with pytest.raises(ConfigError, match=r"pp_zbv.*selective_ac_option = 2"):
        parse_matrix(tree)


def test_planner_layout_check_reads_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshforge.model.flavors import get_flavor
    from meshforge.plan.layout import Layout

    layout = Layout(flavor="debugmodel", seq_len=64, local_batch_size=8, dp_shard=2, compile=True)
    layout.check(get_flavor("debugmodel"))
    monkeypatch.setitem(table.CELLS, ("fsdp", "compile"), table.Cell("refused", "planted", "compile.enable = false"))
    with pytest.raises(ConfigError, match="planted"):
        layout.check(get_flavor("debugmodel"))


def test_float8_on_cpu_without_emulation_warns_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.parallel.float8 import check_float8_support

    check_float8_support(Float8(enable=True, emulate=False), torch.device("cpu"))  # real kernels asked for on a CPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quantize.dense.float8.emulate auto" in err
    for emulate in (True, "auto"):  # an explicit choice, and the default (emulated on a CPU), stay quiet
        check_float8_support(Float8(enable=True, emulate=emulate), torch.device("cpu"))  # type: ignore[arg-type]
        assert capsys.readouterr().err == ""


def test_validate_features_refuses_the_jobs_ac_and_other_columns() -> None:
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1)
    zbv = Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble")
    args = dict(device=torch.device("cpu"), compile_enabled=False, float8=Float8())
    dims.validate_features(zbv, **args, features=["ac_every_n"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="selective_ac_option = 2"):
        dims.validate_features(zbv, **args, features=["ac_selective_op"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tie_embeddings"):
        dims.validate_features(zbv, **args, features=["ac_none", "tied_embeddings"])  # type: ignore[arg-type]


@pytest.mark.parametrize("index", range(0, 60, 7))
def test_job_features_of_a_config_are_the_matrix_jobs_columns(index: int) -> None:
    """composability.job_features (what training and the dry run refuse by) reads each matrix job's config as the
    matrix test's own bookkeeping does (tests/matrix_cover.py)."""
    import matrix_cover as mc

    from meshforge.config.io import load_config
    from meshforge.model.hf_config import resolve_model_args

    jobs = mc.cover(2)
    job = jobs[index % len(jobs)]
    world, argv = mc.overrides(job)
    cfg = load_config(None, argv)
    columns = table.job_features(cfg, resolve_model_args(cfg.model, cfg.training.seq_len))
    assert sorted(set(columns)) == sorted({c for _, c in mc.cells(job)}), mc.describe(job)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    rows = table.active_parallelisms(
        cfg.parallelism,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        cp=dims.cp,
        ep=dims.ep,
        cp_impl=cfg.parallelism.context_parallel_impl,
    )
    assert sorted(rows) == sorted(mc.ROWS[job["layout"]]), mc.describe(job)


def test_a_three_way_refusal_needs_all_of_its_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.cli import main

    for device in ("cpu", "cuda"):  # AOT autograd's, not a device's: refused (or run) alike on both
        assert table.refusal(["tp_sp"], ["ac_full", "compile", "moe"], device) is not None
        assert table.refusal(["tp_sp"], ["ac_every_n", "compile", "moe"], device) is not None  # every N-th: full AC
        assert table.refusal(["tp_sp"], ["ac_full", "compile"], device) is None  # dense: compiled inside the checkpoint
        assert table.refusal(["tp_sp"], ["ac_none", "compile", "moe"], device) is None
        assert table.refusal(["tp_sp"], ["ac_full", "moe"], device) is None
        assert table.refusal(["tp_sp"], ["ac_selective_op", "compile", "moe"], device) is None
    argv = ["train", "--dry-run", "--world-size", "2", "--training.device", "cpu", "--compile.enable"]
    argv += ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"]
    assert main(argv) == 0  # the dense model: runs (tests/distributed/test_tp_compile_full_ac.py)
    capsys.readouterr()
    assert main([*argv, "--model.flavor", "debugmoe"]) == 2
    assert "selective_ac_option = 'op'" in capsys.readouterr().err


def test_every_active_row_and_feature_is_checked() -> None:
    """A refused cell is found wherever it sits among the job's rows and features (the AC column comes first)."""
    error = table.refusal(["fsdp", "ep"], ["ac_selective_op", "compile"])
    assert isinstance(error, ConfigError) and "torch.compile cannot trace" in str(error), "EP x compile not refused"
    features = table.active_features(ac_mode="selective", ac_option="op", compile_enabled=True)
    assert features == ["ac_selective_op", "compile"]
    assert table.refusal(["fsdp", "ep"], ["ac_selective_op"]) is None


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], set()),
        (["--training.gradient_accumulation_steps", "2"], {"grad_sync_once"}),  # auto: once per step under GA
        (["--training.gradient_accumulation_steps", "2", "--gradient_sync.mode", "every_microstep"], set()),
        (
            ["--training.gradient_accumulation_steps", "2", "--gradient_sync.regather", "keep"],
            {"grad_sync_once", "regather_keep"},
        ),
        (
            ["--gradient_sync.mode", "once_per_step", "--gradient_sync.regather", "keep"],
            set(),
        ),  # GA 1: nothing to defer
    ],
)
def test_job_features_name_the_gradient_sync_columns(argv: list[str], want: set[str]) -> None:
    """The [gradient_sync] columns a job's config turns on (what the table's grad_sync_once / regather_keep cells,
    tests/distributed/test_gradient_sync_composability.py, are about) are the modes train_step runs."""
    from meshforge.config.io import load_config
    from meshforge.model.hf_config import resolve_model_args

    cfg = load_config(None, ["--training.local_batch_size", "4", *argv])
    columns = set(table.job_features(cfg, resolve_model_args(cfg.model, cfg.training.seq_len)))
    assert columns & {"grad_sync_once", "regather_keep"} == want, columns
