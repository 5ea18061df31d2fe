# Two entry points: `make demo` (the main job on the built-in CPU default) and `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint venv clean test-mutants
venv: $(VENV)/.ready
$(VENV)/.ready: pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)

demo: $(VENV)/.ready
	$(PY) -m meshforge bench --compare-with reference

lint: $(VENV)/.ready
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/mypy src

test: lint
	$(PY) -m pytest -q --durations=15

# the curated mutation check (tests/mutants/*.toml, scripts/mutants.py): not part of `make test`
test-mutants: $(VENV)/.ready
	$(PY) scripts/mutants.py

clean:
	rm -rf outputs .pytest_cache .mypy_cache .ruff_cache
