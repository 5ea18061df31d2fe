"""Plot max/mean expert load and loss of debugmoe runs (metrics.jsonl of `meshforge train`), one line per run.

Usage: python scripts/plot_moe_balance.py OUT.png LABEL=DUMP_FOLDER [LABEL=DUMP_FOLDER ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(argv: list[str]) -> int:
    out, runs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    fig, (load_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for label, folder in runs:
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records]
        load_ax.plot(steps, [r["moe_max_load"] for r in records], label=label)
        loss_ax.plot(steps, [r["loss"] for r in records], label=label)
        print(f"{label}: max/mean load first {records[0]['moe_max_load']:.2f} last {records[-1]['moe_max_load']:.2f}")
    load_ax.set(xlabel="step", ylabel="max / mean expert load (worst layer)", title="debugmoe expert load")
    loss_ax.set(xlabel="step", ylabel="loss", title="debugmoe loss")
    for ax in (load_ax, loss_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
