"""Entry points for tests/integration/test_warm_launcher.py: what a rank sees, a failing rank, a rank that hangs.
Run by the warm launcher (``path:function``, called with the arguments after the first) or as a torchrun script."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def dump(argv: list[str]) -> int:
    """Write this rank's environment, argv, thread count and parent into ARGV[0]/rank<RANK>.json."""
    import torch

    seen = {"env": dict(os.environ), "argv": sys.argv[1:], "threads": torch.get_num_threads(), "ppid": os.getppid()}
    Path(argv[0], f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))
    return 0


def fail(argv: list[str]) -> int:
    """Rank 1 exits with code 3 at once; the others would sleep for a minute."""
    if os.environ["RANK"] == "1":
        return 3
    time.sleep(60)
    return 0


def hang(argv: list[str]) -> int:
    """Write this rank's pid into ARGV[0]/pid<RANK>, then sleep for ten minutes."""
    Path(argv[0], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)
    return 0


if __name__ == "__main__":
    raise SystemExit({"dump": dump, "fail": fail, "hang": hang}[sys.argv[1]](sys.argv[2:]))
