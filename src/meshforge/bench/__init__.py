"""`meshforge bench`: run a matrix of parallel strategies on the hardware at hand and report which wins.

matrix.py (TOML -> validated runs), spec.py (the runs and their commands), ranks.py (the ranked rank count: one rank
per core or GPU; oversubscribed runs), runner.py (one job per repetition), warm.py + warm_main.py (the warm launcher),
schedule.py (the sequential stopping rule: who gets another repetition), record.py (repetitions -> one record),
stats.py (t intervals, ratios, outliers, ranking, steps per start-up), machine.py (CPU, clocks, load), predict.py (the
planner's leave-one-out predictions), takeaway.py + analysis.py + report.py (report.md), plots.py (PNGs), compare.py
(`bench compare`), reference.py (the article's figures), cli.py (the command, progress, resume).
"""

from meshforge.bench.runner import load_records

__all__ = ["load_records"]
