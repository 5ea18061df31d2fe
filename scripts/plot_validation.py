#!/usr/bin/env python3
"""Plot a run's training loss and validation loss from its metrics.jsonl into a PNG.

Usage: python scripts/plot_validation.py OUTPUT_DIR/metrics.jsonl docs/benchmarks/validation-loss.png [--title T]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    val = [r for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss (logged steps)")
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
