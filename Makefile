# Two entry points: `make demo` (the main job on the built-in CPU default) and `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint venv clean test-isa test-compat test-fake-cuda plan-loo ft-proof test-mutants test-mutants-sample test-matrix
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

# the parity tests under CPU kernels this machine does not run by default: oneMKL's Intel kernels (preloaded), MKL_CBWR=COMPATIBLE,
# ATen's scalar kernels (scripts/test_isa.sh; docs/benchmarks/cpu-parity-noise.md). Not part of `make test`.
test-isa: $(VENV)/.ready
	PY=$(PY) bash scripts/test_isa.sh

# torch compatibility (docs/benchmarks/compat.md): its own venv .venv-torch-$(TORCH), parity subset + smoke vs 2.13
TORCH ?= 2.11.0
test-compat:
	bash scripts/compat_run.sh $(TORCH)

# the fake-CUDA check (scripts/fake_cuda_check.py) in its own venv (.venv-fake-cuda, torch 2.14.1+cu130)
test-fake-cuda: $(VENV)/.ready
	PYTEST_PYTHON=$(PY) bash scripts/fake_cuda_venv.sh

# The planner's leave-one-out folds (after a change to plan/ physics or the published rows; minutes, all cores).
plan-loo: $(VENV)/.ready
	$(PY) -m meshforge.plan.accuracy.folds

# the torchft kill-and-rejoin proof (docs/fault-tolerance.md; ~3 min under load); needs pip install -e '.[ft]'
ft-proof: $(VENV)/.ready
	MESHFORGE_FT_FIGURES=outputs/ft_figures.json $(PY) -m pytest -q -s tests/integration/test_fault_tolerance.py tests/integration/test_fault_tolerance_hang.py

# the composability matrix over every layout, with compile (docs/composability.md; `make test` runs CI's pairwise cover);
# outputs/matrix_full.json feeds `python -m meshforge.parallel.composability_measured ci.json outputs/matrix_full.json`
test-matrix: $(VENV)/.ready
	mkdir -p outputs && MESHFORGE_MATRIX=full MESHFORGE_MATRIX_LOG=outputs/matrix_jobs.log MESHFORGE_MATRIX_OUT=outputs/matrix_full.json $(PY) -m pytest -q -s tests/distributed/test_composability_matrix.py::test_full_matrix

# the curated mutation check (tests/mutants/*.toml, scripts/mutants.py): not part of `make test`
test-mutants: $(VENV)/.ready
	$(PY) scripts/mutants.py

# N mutants drawn automatically in the modules a change touched (git diff BASE: default origin/main, else HEAD~1)
test-mutants-sample: $(VENV)/.ready
	$(PY) scripts/mutants_sample.py $(if $(BASE),--base $(BASE)) $(if $(TO),--to $(TO)) $(if $(N),-n $(N))

clean:
	rm -rf outputs .pytest_cache .mypy_cache .ruff_cache
