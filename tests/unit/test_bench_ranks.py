"""The ranked rank count (one rank per core or GPU), `ranks = 0` / axis -1 resolution, oversubscribed runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from meshforge.bench import machine, ranks
from meshforge.bench.matrix import parse_matrix
from meshforge.errors import ConfigError

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "bench" / "default.toml"


@pytest.mark.parametrize(
    ("device", "cores", "gpus", "cap", "want"),
    [
        ("cpu", 2, 0, 4, 2),
        ("cpu", 3, 0, 4, 2),  # a power of two: the degrees must divide heads and the global batch
        ("cpu", 4, 0, 4, 4),
        ("cpu", 64, 0, 4, 4),  # the matrix's cap (global batch 4)
        ("cpu", 64, 0, 0, 64),
        ("cpu", 1, 0, 4, 2),  # at least 2: a comparison needs a collective (then oversubscribed)
        ("cuda", 2, 8, 0, 8),  # GPUs, not cores
        ("cuda", 2, 8, 4, 4),
    ],
)
def test_ranked_ranks_follow_the_cores_or_gpus(device: str, cores: int, gpus: int, cap: int, want: int) -> None:
    assert ranks.ranked_ranks(device, cores, gpus, cap) == want


def default_on(cores: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setattr(machine, "cpu_cores", lambda: cores)
    matrix = parse_matrix(tomllib.loads(DEFAULT.read_text()), device="cpu")
    return {"matrix": matrix, "runs": {r.name: r for r in matrix.runs}}


def test_the_default_ranks_at_one_rank_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    two = default_on(2, monkeypatch)
    runs, matrix = two["runs"], two["matrix"]
    assert matrix.cores == 2 and matrix.ranked_ranks == 2
    assert runs["tp"].ranks == 2 and runs["tp"].layout()["tp"] == 2 and runs["tp"].resolved_dp_shard == 1
    assert runs["pp_zbv"].layout()["pp"] == 2 and runs["cp"].layout()["cp"] == 2 and runs["fsdp"].dp == 2
    ranked = [n for n, r in runs.items() if not matrix.oversubscribed(r)]
    assert {"fsdp", "fsdp_compile", "fsdp_float8", "tp", "pp_1f1b", "pp_interleaved", "pp_zbv", "cp"} <= set(ranked)
    assert matrix.oversubscribed(runs["fsdp_tp"]) and matrix.oversubscribed(runs["3d"])
    assert matrix.scaling["fsdp_scaling"] == ["fsdp_r1", "fsdp"]

    four = default_on(4, monkeypatch)
    runs, matrix = four["runs"], four["matrix"]
    assert matrix.ranked_ranks == 4 and runs["tp"].layout()["tp"] == 4 and runs["pp_1f1b"].layout()["pp"] == 4
    assert not matrix.oversubscribed(runs["fsdp_tp"]) and matrix.oversubscribed(runs["3d"])  # 2D ranked on 4 cores
    assert matrix.scaling["fsdp_scaling"] == ["fsdp_r1", "fsdp_r2", "fsdp"]

    many = default_on(96, monkeypatch)
    assert many["matrix"].ranked_ranks == 4 and not many["matrix"].oversubscribed(many["runs"]["3d"])


def test_axis_minus_one_takes_the_rest_and_mistakes_name_the_key() -> None:
    tree = {
        "bench": {"name": "m", "flavor": "debugmodel", "seq_len": 64, "global_batch_size": 4, "warmup_steps": 1,
                  "measured_steps": 2, "cores": 8, "ranked_ranks": 4},
        "run": [{"name": "tp", "ranks": 0, "tp": -1}, {"name": "dp_tp", "ranks": 0, "dp_shard": 2, "tp": -1}],
    }  # fmt: skip
    runs = {r.name: r for r in parse_matrix(tree, device="cpu").runs}
    assert runs["tp"].layout()["tp"] == 4 and runs["tp"].resolved_dp_shard == 1
    assert (runs["dp_tp"].resolved_dp_shard, runs["dp_tp"].tp) == (2, 2)
    tree["run"] = [{"name": "bad", "ranks": 0, "tp": -1, "pp": -1}]
    with pytest.raises(ConfigError, match="tp and pp are both -1"):
        parse_matrix(tree, device="cpu")
    tree["run"] = [{"name": "bad", "ranks": 0, "tp": -1, "dp_shard": 8}]
    with pytest.raises(ConfigError, match="cannot hold"):
        parse_matrix(tree, device="cpu")
    tree["bench"]["cores"] = -1
    with pytest.raises(ConfigError, match=r"bench\.cores"):
        parse_matrix(tree, device="cpu")


def test_gpus_are_never_oversubscribed() -> None:
    assert ranks.oversubscribed(8, 0) is False and ranks.oversubscribed(8, 2) is True
    assert ranks.oversubscribed(2, 2) is False
