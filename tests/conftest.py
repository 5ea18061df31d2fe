"""Shared test set-up: offline, one thread, tests see the repository root as the working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def pytest_configure(config: pytest.Config) -> None:
    """Every temporary folder of the session (tempfile's, in this process, forked ranks and subprocesses: TMPDIR)
    lives in one ``meshforge-tests-*`` folder of the system temp folder, removed when the session ends: tests and ranks
    that ``mkdtemp`` their dump folders leave nothing behind. torch's compile cache keeps its usual place."""
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # before the redirection below
    base = tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="meshforge-tests-", dir=base)
    config.stash[_TEMP] = (folder, tempfile.tempdir, os.environ.get("TMPDIR"))
    tempfile.tempdir = folder
    os.environ["TMPDIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil
    import tempfile

    if _TEMP not in config.stash:
        return
    folder, before, env = config.stash[_TEMP]
    tempfile.tempdir = before
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    shutil.rmtree(folder, ignore_errors=True)


_TEMP = pytest.StashKey[tuple[str, "str | None", "str | None"]]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The random test order's seed, also under -q (pytest-randomly prints it only in the header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"test order: pytest-randomly seed {seed} (same order: --randomly-seed={seed})")
