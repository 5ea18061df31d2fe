"""plan --guide: the flow is derived from the table, every recommended layout passes the dry run's checks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshforge.config.io import load_config
from meshforge.plan.guide import flow as guide_flow
from meshforge.plan.guide import guide
from meshforge.plan.hardware import auto_param_dtype, load_hardware
from meshforge.plan.layout import layout_args, layout_from_config

MODEL = ("--model.flavor", "8B")
WORLDS = (8, 16, 32)
SEQ = 8192


@pytest.fixture(scope="module")
def h100_cells() -> list[dict]:
    return guide.compute_guide(load_hardware("h100"), [MODEL], WORLDS, (SEQ,), use_cache=False, workers=1)


def leaves(cells: list[dict]) -> set[tuple[str, str, str]]:
    return set(guide_flow.flow_edges(guide_flow.flow(cells)))


def test_flow_leaves_are_the_table_segments(h100_cells: list[dict]) -> None:
    """Every cell's recommended family is the family of the flow leaf whose GPU range holds it, and back."""
    edges = guide_flow.flow_edges(guide_flow.flow(h100_cells))
    assert edges, "the flow has no leaves"
    for cell in h100_cells:
        holding = [fam for model, rng, fam in edges if model == cell["model"] and _holds(rng, cell["world"])]
        assert holding == [guide_flow.recommended_family(cell)], (cell["world"], holding)
    assert len({fam for _, _, fam in edges}) == len(guide_flow.segments(h100_cells))


def _holds(rng: str, world: int) -> bool:
    lo, _, hi = rng.removesuffix(" GPUs").partition("-")
    return int(lo) <= world <= int(hi or lo)


def test_boundary_moves_with_a_hardware_constant(h100_cells: list[dict]) -> None:
    """A slower inter-node network moves where the recommendation changes: the flow follows the table."""
    hw = load_hardware("h100")
    slow = dataclasses.replace(
        hw, spec=dataclasses.replace(hw.spec, inter_node_bandwidth=hw.spec.inter_node_bandwidth / 50)
    )
    slow_cells = guide.compute_guide(slow, [MODEL], WORLDS, (SEQ,), use_cache=False, workers=1)
    before = [guide_flow.recommended_family(c) for c in h100_cells]
    after = [guide_flow.recommended_family(c) for c in slow_cells]
    assert before != after
    assert leaves(h100_cells) != leaves(slow_cells)


def test_runner_up_differs_and_is_slower_or_simpler(h100_cells: list[dict]) -> None:
    for cell in h100_cells:
        best, runner = cell["best"], cell["runner_up"]
        assert runner["layout"] != best["layout"]
        assert runner["family"] != best["family"] or len(cell["families"]) == 1
        assert cell["separable"] == (not best["tps_low"] <= runner["tps"] <= best["tps_high"])
        assert cell["deciding"]


def test_families_are_labelled_by_their_degrees(h100_cells: list[dict]) -> None:
    for cell in h100_cells:
        for fam, est in cell["families"].items():
            d = est["degrees"]
            expected = "4D" if d["cp"] > 1 else "3D" if d["pp"] > 1 else "FSDP x TP" if d["tp"] > 1 else "FSDP"
            assert fam == expected == est["family"], est["layout"]
            assert est["tps"] <= max(e["tps"] for e in cell["families"].values())


def test_recommended_layouts_pass_the_dry_run(h100_cells: list[dict]) -> None:
    """The flags of every recommendation and runner-up: config validation, the planner's layout checks (the same
    layout back), and the dry run (real mesh, model on meta, parallelize, pipeline plan)."""
    from meshforge.tools.dry_run import plan

    hw = load_hardware("h100")
    dry_run_families: set[str] = set()
    for cell in h100_cells:
        for est in (cell["best"], cell["runner_up"]):
            cfg = load_config(None, est["overrides"])
            layout = layout_from_config(cfg, cell["world"], impl=cell["impl"], auto_dtype=auto_param_dtype(hw.spec))
            layout.check(layout_args(layout))
            assert layout.describe() == est["layout"]
            if est["family"] not in dry_run_families:  # one per family (test time); runner-ups are other families
                dry_run_families.add(est["family"])
                assert plan(cfg, cell["world"]).world_size == cell["world"]
    assert len(dry_run_families) >= 2


def test_article_commands_regenerated_and_markdown(h100_cells: list[dict]) -> None:
    cmds = guide_flow.command_lines(h100_cells, "h100")
    assert len(cmds) == 1 and "--parallelism.data_parallel_shard_degree" in cmds[0][1]
    text = guide_flow.markdown(h100_cells, "h100")
    assert "```mermaid" in text and text.count("| 8B |") == len(WORLDS)
    json.dumps(h100_cells)


def test_cache_reuses_cells(tmp_path, monkeypatch, h100_cells: list[dict]) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    hw = load_hardware("h100")
    first = guide.compute_guide(hw, [MODEL], (8,), (SEQ,), workers=1)
    assert len(list((tmp_path / "guide").glob("*.json"))) == 1
    monkeypatch.setattr(guide, "compute_cell", lambda *a: pytest.fail("searched again"))
    assert guide.compute_guide(hw, [MODEL], (8,), (SEQ,), workers=1) == first


def test_curves_follow_the_families(h100_cells: list[dict], tmp_path) -> None:
    """Each family's curve is that family's best layout per GPU count, the PNG is written, and article points carry
    the family of their own degrees (table 2: FSDP x TP, table 3: 3D, table 4 with CP: 4D)."""
    from meshforge.plan.guide import curves

    for fam, rows in curves.family_curves(h100_cells, "8B", SEQ).items():
        for world, tps, low, high in rows:
            est = next(c for c in h100_cells if c["world"] == world)["families"][fam]
            assert (tps, low, high) == (est["tps"], est["tps_low"], est["tps_high"]) and est["family"] == fam
            assert low < tps < high
    by_table = {(m, s, w): fam for m, s, w, fam, _, _ in curves.article_points()}
    assert by_table[("8B", 8192, 8)] == "FSDP" and by_table[("70B", 8192, 256)] == "FSDP x TP"
    assert by_table[("405B", 8192, 512)] == "3D" and by_table[("405B", 65536, 512)] == "4D"  # seq 32k: CP 1
    (path,) = curves.write_curves(h100_cells, "h100", tmp_path)
    assert path.stat().st_size > 10_000


def test_guide_flags_are_one_line_errors() -> None:
    from meshforge.errors import ConfigError
    from meshforge.plan.cli import main

    with pytest.raises(ConfigError, match="--world-sizes"):
        main(["--guide", "--hardware", "h100", "--world-sizes", "8,x"])
    with pytest.raises(ConfigError, match="only --model"):
        main(["--guide", "--hardware", "h100", "--training.seq_len", "4096"])


@pytest.mark.slow
def test_article_launches_pass_the_full_scale_dry_run() -> None:
    """The three regenerated launches (8B at 8, 70B at 256, 405B at 512 H100s) through the real dry run (~3 CPU-min
    cold: three full searches and three meta-model builds)."""
    from meshforge.tools.dry_run import plan

    points = guide_flow.ARTICLE_COMMANDS
    cells = [
        guide.compute_cell(load_hardware("h100"), ("--model.flavor", model), world, seq, "meshforge")
        for model, world, seq, _ in points
    ]
    assert len(guide_flow.command_lines(cells, "h100")) == 3
    for cell in cells:
        assert plan(load_config(None, cell["best"]["overrides"]), cell["world"]).world_size == cell["world"]
