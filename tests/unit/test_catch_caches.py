"""Each cache policy's defining case and every cache key varied input by input (issue 37: "policies tested without
their defining case", "cache keys that miss an input"): the shard map cache evicts the least recently used map, not
the first opened; the planner's folds key, the guide's cell key and source digest, the CPU peak probe's key and the
prepared-corpus key each change with every input they stand for (a changed input must miss the cache)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshforge.data import corpus
from meshforge.data.prepare import PrepareOptions
from meshforge.data.reader import MapCache
from meshforge.device import peak
from meshforge.plan.accuracy import folds
from meshforge.plan.accuracy.fit import Observation
from meshforge.plan.guide import guide
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout


def test_the_map_cache_evicts_the_least_recently_used_map() -> None:
    opened: list[int] = []

    def opener(key: int) -> np.ndarray:
        opened.append(key)
        return np.full(2, key)

    cache = MapCache(2, opener)
    cache.get(1), cache.get(2), cache.get(1)  # 1 used after 2: 2 is the least recently used
    cache.get(3)  # evicts 2, keeps 1
    assert list(cache.maps) == [1, 3]
    cache.get(1)
    assert opened == [1, 2, 3], "a recently used map was closed and opened again"
    cache.get(2)
    assert opened == [1, 2, 3, 2] and list(cache.maps) == [1, 2] and int(cache.get(2)[0]) == 2


def observation(**kw: object) -> Observation:
    base: dict[str, object] = dict(
        name="row", layout=Layout(flavor="8B", seq_len=8192, local_batch_size=2, dp_shard=8), tps_per_device=1000.0
    )
    base |= dict(peak_memory_gib=40.0, emulated=False, hardware=load_hardware("h100"))
    return Observation(**{**base, **kw})  # type: ignore[arg-type]


def test_the_folds_key_changes_with_every_field_of_every_row_and_with_the_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = folds.cache_key([observation(), observation(name="other")])
    variants = {
        "name": observation(name="renamed"),
        "layout": observation(layout=Layout(flavor="8B", seq_len=8192, local_batch_size=2, dp_shard=4, tp=2)),
        "tps": observation(tps_per_device=1001.0),
        "peak": observation(peak_memory_gib=41.0),
        "emulated": observation(emulated=True),
        "hardware": observation(hardware=load_hardware("a100")),
    }
    for field, changed in variants.items():
        assert folds.cache_key([changed, observation(name="other")]) != base, f"{field} does not reach the key"
        assert folds.cache_key([observation(), changed if field != "name" else observation(name="x")]) != base, field
    assert folds.cache_key([observation(name="other"), observation()]) != base  # the order of the rows too
    real = Path.read_bytes
    for rel in folds.PREDICTION_SOURCES:
        planted = folds.ROOT / rel
        monkeypatch.setattr(Path, "read_bytes", lambda p, t=planted: real(p) + (b"#" if p == t else b""))
        assert folds.cache_key([observation(), observation(name="other")]) != base, f"{rel} does not reach the key"
        monkeypatch.setattr(Path, "read_bytes", real)


def test_the_guide_cell_key_changes_with_every_input() -> None:
    hw = load_hardware("h100")
    args = (hw, ("--model.flavor", "8B"), 64, 8192, "meshforge", "digest")
    base = guide._cell_key(*args)
    slower = dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, matmul=hw.efficiency.matmul * 0.9))
    other_spec = dataclasses.replace(
        hw, spec=dataclasses.replace(hw.spec, memory_bandwidth=hw.spec.memory_bandwidth / 2)
    )
    changed = [
        (other_spec, *args[1:]),
        (slower, *args[1:]),
        (dataclasses.replace(hw, spec=dataclasses.replace(hw.spec, name="renamed")), *args[1:]),
        (hw, ("--model.flavor", "70B"), *args[2:]),
        (*args[:2], 128, *args[3:]),
        (*args[:3], 4096, *args[4:]),
        (*args[:4], "torchtitan", args[5]),
        (*args[:5], "other"),
    ]
    keys = [guide._cell_key(*c) for c in changed]  # type: ignore[arg-type]
    assert base not in keys and len(set(keys)) == len(keys)


@pytest.mark.parametrize(
    "rel",
    ["plan/physics/levers.py", "plan/search/advisor.py", "plan/accuracy/interval.py", "plan/layout.py",
     "model/moe.py", "parallel/context_parallel/api.py", "parallel/degrees.py"],
)  # fmt: skip
def test_the_guide_digest_covers_the_planners_sub_rooms(rel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(guide.__file__).resolve().parents[2]
    assert (root / rel).is_file()
    base = guide._planner_digest()
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"#" if p == root / rel else b""))
    assert guide._planner_digest() != base, f"a change to {rel} does not make the cached guide cells stale"


def test_the_cpu_peak_cache_misses_on_each_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    probes: list[tuple[torch.dtype, int]] = []
    model = ["cpu A"]

    def probe(dtype: torch.dtype, seconds: float = 0.0) -> float:
        probes.append((dtype, torch.get_num_threads()))
        return float(len(probes))

    monkeypatch.setattr(peak, "matmul_probe", probe)
    monkeypatch.setattr(peak, "cpu_model", lambda: model[0])
    assert peak.cached_cpu_peak(torch.float32, 1) == 1.0
    assert peak.cached_cpu_peak(torch.float32, 1) == 1.0 and len(probes) == 1  # a hit
    assert peak.cached_cpu_peak(torch.bfloat16, 1) == 2.0  # the dtype
    assert peak.cached_cpu_peak(torch.float32, 2) == 3.0 and probes[-1] == (torch.float32, 2)  # the threads
    model[0] = "cpu B"
    assert peak.cached_cpu_peak(torch.float32, 1) == 4.0  # the machine
    assert len(json.loads(peak.peak_cache().read_text())) == 4


def test_the_prepared_corpus_key_misses_on_each_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    fingerprint = ["tok-a"]
    monkeypatch.setattr(corpus, "build_tokenizer", lambda path: SimpleNamespace(fingerprint=fingerprint[0]))

    def fake_prepare(inputs: list[str], folder: Path, options: PrepareOptions) -> None:
        folder.mkdir(parents=True)
        (folder / corpus.MANIFEST).write_text("{}")

    monkeypatch.setattr(corpus, "prepare", fake_prepare)
    base_options = PrepareOptions()
    base = corpus.cached_prepared(["x.txt"], ["x.txt", "10", "1.0"], base_options)
    assert corpus.cached_prepared(["x.txt"], ["x.txt", "10", "1.0"], base_options) == base  # a hit
    folders = {base}
    for field, value in (("val_docs", 3), ("val_fraction", 0.1), ("shard_tokens", 1 << 20), ("max_tokens", 99),
                         ("text_field", "body"), ("tokenizer_path", "other.json")):  # fmt: skip
        before = len(folders)
        folders.add(corpus.cached_prepared(["x.txt"], ["x.txt", "10", "1.0"], replace(base_options, **{field: value})))
        assert len(folders) == before + 1, f"{field} does not reach the prepared corpus's key"
    for parts in (["x.txt", "11", "1.0"], ["x.txt", "10", "2.0"], ["y.txt", "10", "1.0"]):
        folders.add(corpus.cached_prepared(["x.txt"], parts, base_options))
    fingerprint[0] = "tok-b"
    folders.add(corpus.cached_prepared(["x.txt"], ["x.txt", "10", "1.0"], base_options))
    assert len(folders) == 1 + 6 + 3 + 1, "an input of the prepared corpus does not reach its cache key"
