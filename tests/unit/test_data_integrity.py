"""Prepared shards at scale: bounded open files (20,000 shards under `ulimit -n 256`, two ranks, document masking),
integrity (`data verify`, the check at open, data.verify = full), crash-consistent preparation (kill -9 at 10 seeded
points, fsync before the manifest, only its own files deleted)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshforge.cli import main as meshforge_main
from meshforge.data import integrity, shards
from meshforge.data.manifest import MANIFEST, read_manifest
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.shards import PreparedSplit
from meshforge.data.tokenizer import REPO_ROOT, build_tokenizer
from meshforge.errors import ConfigError

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")


def _jsonl(path: Path, documents: int, words: int = 6) -> str:
    rows = (json.dumps({"text": f"Emma {i} was " + " ".join(["handsome"] * (1 + i % words))}) for i in range(documents))
    path.write_text("".join(row + "\n" for row in rows))
    return str(path)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20,000 one-document shards (fsync is skipped while building them: 40,000 fsyncs take minutes here)."""
    root = tmp_path_factory.mktemp("many")
    inputs = _jsonl(root / "in.jsonl", 20_000)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", lambda fd: None)
        prepare([inputs], root / "out", PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=8, val_docs=0))
    return root / "out"


STEPS = 20
"""Enough to touch ~80 shards per rank (160 files without the cache's bound: far past the 8 + 8 it keeps); 50 steps
(~200 shards) took 2.5 x the training time and caught nothing more."""


def _train_under_ulimit(folder: str, max_open: int) -> dict[str, int]:
    """Inside a rank: RLIMIT_NOFILE 256, train STEPS steps on folder with document masking; the most fds seen."""
    from meshforge.config.io import load_config
    from meshforge.train.loop import train

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    seen = {"before": _open_fds(), "most": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen["most"] = max(seen["most"], _open_fds())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    argv = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--training.steps", str(STEPS), "--training.dataset", "prepared", "--training.dataset_path", folder]
    argv += ["--training.document_mask", "--data.max_open_shards", str(max_open), "--metrics.log_freq", str(STEPS)]
    argv += ["--activation_checkpoint.mode", "none", "--job.dump_folder", f"{folder}-dump-{os.environ['RANK']}"]
    records = train(load_config(None, argv))
    done.set()
    sampler.join()
    return {**seen, "steps": int(records[-1]["step"])}


def test_twenty_thousand_shards_keep_open_files_bounded(many_shards: Path) -> None:
    from launcher import run_ranks

    assert len(PreparedSplit(many_shards).shard_names) == 20_000
    for rank in run_ranks(_train_under_ulimit, 2, str(many_shards), 8, timeout=120):
        assert rank["steps"] == STEPS
        # 8 .bin maps + 8 .idx maps, whatever the shard count (20 steps x 2 windows touch ~80 shards)
        assert rank["most"] - rank["before"] <= 2 * 8 + 24, rank


def test_lru_closes_evicted_maps(tmp_path: Path) -> None:
    many_shards = tmp_path / "out"
    prepare([_jsonl(tmp_path / "in.jsonl", 300)], many_shards, PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=8))
    split = PreparedSplit(many_shards, max_open_shards=4)
    assert len(split.shard_names) >= 250
    before = _open_fds()
    rng = np.random.default_rng(0)
    for start in rng.integers(0, split.num_tokens - 40, size=300):
        assert len(split.read(int(start), 40)) == 40
        split.document_starts(int(start), 40)
    assert _open_fds() - before <= 8
    assert split.read(0, 5).tolist() == np.asarray(np.memmap(many_shards / "train-00000.bin", np.uint16))[:5].tolist()


def _small(root: Path, **kwargs: Any) -> Path:
    inputs = _jsonl(root / "in.jsonl", 60)
    options = PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=120, val_docs=4, **kwargs)
    prepare([inputs], root / "out", options)
    return root / "out"


def test_verify_names_every_bad_file_and_open_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _small(tmp_path)
    assert meshforge_main(["data", "verify", str(out)]) == 0
    assert integrity.verify(out) == []
    flipped = out / "train-00001.bin"
    data = bytearray(flipped.read_bytes())
    data[3] ^= 1
    flipped.write_bytes(bytes(data))
    PreparedSplit(out)  # same size: only the checksum tells
    with pytest.raises(ConfigError, match=r"train-00001\.bin has another sha256.*meshforge data verify"):
        PreparedSplit(out, verify="full")
    (out / "train-00002.idx").unlink()
    (out / "train-00003.idx").write_bytes((out / "train-00004.idx").read_bytes())  # a stale index
    with pytest.raises(ConfigError, match=r"train-00002\.idx is missing.*meshforge data verify"):
        PreparedSplit(out)
    capsys.readouterr()
    assert meshforge_main(["data", "verify", str(out)]) == 1
    err = capsys.readouterr().err
    for name in ("train-00001.bin", "train-00002.idx", "train-00003.idx"):
        assert name in err, err
    assert "train-00004" not in err and "val-" not in err


def test_shard_removed_after_open_is_one_line(tmp_path: Path) -> None:
    out = _small(tmp_path)
    split = PreparedSplit(out)
    (out / "train-00002.bin").unlink()
    with pytest.raises(ConfigError, match=r"train-00002\.bin.*meshforge data verify"):
        split.read(int(split.starts[2]), 4)


def _prepare_killed_after(inputs: str, out: Path, k: int) -> None:
    os.environ["MESHFORGE_PREPARE_KILL_AFTER"] = str(k)
    try:
        prepare([inputs], out, PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=120, val_docs=4))
    finally:
        os._exit(0)


def _checksums(manifest: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    return {split: [(s["name"], s["sha256"]) for s in info["shards"]] for split, info in manifest["splits"].items()}


def test_kill_at_ten_points_leaves_a_dataset_or_a_clean_restart(tmp_path: Path) -> None:
    inputs = _jsonl(tmp_path / "in.jsonl", 60)
    options = PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=120, val_docs=4)
    reference = _checksums(prepare([inputs], tmp_path / "reference", options))
    points = 60 + 2 * sum(len(v) for v in reference.values()) + 2  # documents, renames, the manifest's two
    ctx = mp.get_context("fork")
    outcomes = []
    for trial, k in enumerate(sorted(random.Random(23).sample(range(1, points + 1), 10))):
        out = tmp_path / f"out{trial}"
        (out).mkdir()
        (out / "notes.txt").write_text("the user's own file")
        child = ctx.Process(target=_prepare_killed_after, args=(inputs, out, k))
        child.start()
        child.join(60)
        if (out / MANIFEST).exists():
            assert integrity.verify(out) == [], k
            outcomes.append("verified")
        else:
            assert child.exitcode == -9, (k, child.exitcode)
            assert _checksums(prepare([inputs], out, options)) == reference, k
            outcomes.append("rerun")
        assert (out / "notes.txt").read_text() == "the user's own file"
        assert _checksums(json.loads((out / MANIFEST).read_text())) == reference
    assert "rerun" in outcomes, outcomes


def test_fsync_of_every_shard_and_the_folder_before_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == MANIFEST:
            synced.append("manifest renamed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = _small(tmp_path)
    before = synced[: synced.index("manifest renamed")]
    names = [s["name"] for info in read_manifest(out)["splits"].values() for s in info["shards"]]
    for name in names:
        assert str(out / f"{name}.tmp") in before, name
        assert str(out / name.replace(".bin", ".idx.tmp")) in before, name
    assert str(out) in before[-2:] or str(out.resolve()) in before[-2:]


def test_foreign_files_are_never_deleted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "train-mine.bin"
    mine.write_bytes(b"user data")
    assert shards.remove_leftovers(out) == []
    (out / shards.JOURNAL).write_text("train-00000.bin.tmp\ntrain-00000.bin\n")  # as an interrupted prepare leaves
    (out / "train-00000.bin.tmp").write_bytes(b"partial")
    with pytest.raises(ConfigError, match=r"train-mine\.bin"):
        _small(tmp_path)
    assert mine.read_bytes() == b"user data"
    assert sorted(p.name for p in out.iterdir()) == ["train-mine.bin"]


def test_val_fraction_rounding_to_none_holds_out_the_last_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = _jsonl(tmp_path / "in.jsonl", 25)
    options = PrepareOptions(tokenizer_path=TOKENIZER, val_fraction=0.01)
    manifest = prepare([inputs], tmp_path / "out", options)
    assert "rounds to none: holding out the last document" in capsys.readouterr().err
    assert (manifest["splits"]["val"]["documents"], manifest["splits"]["train"]["documents"]) == (1, 24)
    val, train = PreparedSplit(tmp_path / "out", "val"), PreparedSplit(tmp_path / "out", "train")
    assert val.document(0).tolist() == list(val.read(0, val.num_tokens))
    tokenizer = build_tokenizer(TOKENIZER)
    assert tokenizer.decode(val.document(0).tolist()[1:-1]).startswith("Emma 24 was")
    assert tokenizer.decode(train.document(23).tolist()[1:-1]).startswith("Emma 23 was")
    assert manifest["stats"]["train_tokens"] == train.num_tokens
    many = prepare([_jsonl(tmp_path / "many.jsonl", 400)], tmp_path / "many", options)
    assert "rounds to none" not in capsys.readouterr().err and many["splits"]["val"]["documents"] == 3


def test_full_verify_reads_every_index_offset(tmp_path: Path) -> None:
    """An .idx whose first and last offsets and length are right but whose middle offsets do not increase (a
    document boundary scrambled) passes the cheap check; `data verify` and data.verify = full must name it, and the
    sum of the shards' counts must equal the manifest's."""
    out = _small(tmp_path)
    name = "train-00001.idx"
    offsets = np.load(out / name)
    assert len(offsets) >= 3, offsets
    offsets[1], offsets[2] = offsets[2], offsets[1]  # not increasing any more; first, last and length unchanged
    with open(out / name, "wb") as f:  # np.save on a path would append .npy
        np.save(f, offsets)
    PreparedSplit(out)  # the cheap check cannot see it
    assert integrity.verify(out) == [f"{out / name} has offsets that do not increase"], "verify skipped the offsets"
    with pytest.raises(ConfigError, match=r"train-00001\.idx has offsets that do not increase"):
        PreparedSplit(out, verify="full")
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["splits"]["train"]["documents"] += 1
    (out / MANIFEST).write_text(json.dumps(manifest))
    problems = integrity.verify(out)
    assert len(problems) == 2 and "train documents" in problems[0], "verify did not sum the shards' documents"
