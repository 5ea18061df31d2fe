#!/usr/bin/env bash
# make test-isa: the parity tests under the CPU kernels this machine does not run by default (issue 43). Each variant
# runs the same tests; the first line of each says which oneMKL kernels were active (scripts/isa/kernels.py).
#   intel-mkl       oneMKL's Intel kernels, preloaded on any x86 (scripts/isa/fake_intel_mkl.c; needs a C compiler)
#   mkl-compatible  MKL_CBWR=COMPATIBLE: oneMKL's SSE2 branch, another blocking of every matmul
#   aten-default    ATEN_CPU_CAPABILITY=default: ATen's scalar kernels instead of AVX2 / AVX-512 ones
# ISA_TESTS overrides the tests; ISA_VARIANTS the variants.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TESTS=${ISA_TESTS:-"tests/distributed/test_composability_matrix.py::test_pairwise_matrix tests/distributed/test_tp_cp_parity.py tests/distributed/test_chunked_loss_parity.py tests/distributed/test_qwen_parity.py tests/unit/test_isa_blocking.py"}
VARIANTS=${ISA_VARIANTS:-"intel-mkl mkl-compatible aten-default"}
mkdir -p outputs
failed=()
for v in $VARIANTS; do
  env=()
  case $v in
    intel-mkl)
      cc -shared -fPIC -o outputs/libfake_intel_mkl.so scripts/isa/fake_intel_mkl.c || { echo "test-isa: no C compiler (cc): apt-get install gcc"; exit 2; }
      env=(LD_PRELOAD="$PWD/outputs/libfake_intel_mkl.so") ;;
    mkl-compatible) env=(MKL_CBWR=COMPATIBLE) ;;
    aten-default) env=(ATEN_CPU_CAPABILITY=default) ;;
    *) echo "test-isa: unknown variant $v (intel-mkl, mkl-compatible, aten-default)"; exit 2 ;;
  esac
  echo "== $v: oneMKL kernels $(env "${env[@]}" "$PY" scripts/isa/kernels.py)"
  # shellcheck disable=SC2086
  env "${env[@]}" ISA_VARIANT="$v" "$PY" -m pytest -q -p no:randomly $TESTS || failed+=("$v")
done
[ ${#failed[@]} -eq 0 ] || { echo "test-isa: failed under ${failed[*]}"; exit 1; }
