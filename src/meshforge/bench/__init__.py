"""`meshforge bench`: run a matrix of parallel strategies on the hardware at hand and report which wins.

matrix.py (TOML -> runs -> commands), runner.py (one torchrun job per run -> one record), report.py (parity and
report.md), plots.py (PNGs), reference.py (the article's figures), cli.py (the command, progress, resume).
"""

from meshforge.bench.runner import load_records

__all__ = ["load_records"]
