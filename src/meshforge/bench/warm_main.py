"""The warm launcher's process entry: ``python -m meshforge.bench.warm_main`` (bench/warm.py's ``serve``).

Its own module because the package imports bench/warm.py (runner.py uses the launcher): running that module itself
with ``-m`` would import it twice, once as ``meshforge.bench.warm`` and once as ``__main__``, and runpy warns
("found in sys.modules after import of package") on every sweep.
"""

from __future__ import annotations

from meshforge.bench.warm import serve

if __name__ == "__main__":
    raise SystemExit(serve())
