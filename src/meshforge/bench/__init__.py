"""`meshforge bench`: run a matrix of parallel strategies on the hardware at hand and report which wins.

matrix.py (TOML -> runs -> commands), runner.py (one torchrun job per repetition), record.py (repetitions -> one
record), stats.py (bootstrap intervals, outliers, ranking), machine.py (CPU, clocks, load), predict.py (the planner's
leave-one-out predictions), analysis.py + report.py (report.md), plots.py (PNGs), compare.py (`bench compare`),
reference.py (the article's figures), cli.py (the command, progress, resume).
"""

from meshforge.bench.runner import load_records

__all__ = ["load_records"]
