#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA backend, run the GPU tests (pytest -m cuda) and the benchmarks,
# writing everything under $OUT (build.log, check.log, tests.log, bench.txt, gpu.txt). Prints a short summary last.
#   OUT=/tmp/out scripts/device.sh            # env: EXL2_CUDA_ARCHS (default 90), PYTEST_ARGS, BENCH_ARGS
# Exit status: 1 build failed, 3 tests failed, 2 kernel self-check failed, 4 benchmark failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
# EXL2CPP_FIXTURES is the shared fixtures folder holding exl2-smol4/ (CONTRIBUTING.md "Fixtures"), as for the tests.
if [ -n "${EXL2CPP_FIXTURES:-}" ] && [ -f "$EXL2CPP_FIXTURES/fx_q40.safetensors" ]; then
  echo "EXL2CPP_FIXTURES=$EXL2CPP_FIXTURES is the exl2-smol4 folder itself: point it at the folder that holds" \
    "exl2-smol4/ (e.g. carry .devfx/exl2-smol4 and set EXL2CPP_FIXTURES=\$PWD/.devfx)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/exl2cpp-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)

# Python packages missing on that machine travel as wheels in .whl/ (see /work/.library/device/README.md).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "warning: wheel install from .whl failed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader >"$OUT/gpu.txt" 2>&1 || true

echo "== build (EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90})"
EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1
build_rc=$?
tail -3 "$OUT/build.log"
t_build=$(($(date +%s) - t0))
if [ $build_rc -ne 0 ]; then
  grep -E "error|FAILED" "$OUT/build.log" | head -30
  echo "== SUMMARY: BUILD FAILED (rc $build_rc) after ${t_build}s; see build.log"
  exit 1
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import exl2cpp._C as C; print('exl2cpp._C loaded; cuda_bench:', hasattr(C, 'cuda_bench'))"

echo "== kernel self-check (dev/kernels/check_kernels.sh: fast paths, then option cuda_reference)"
dev/kernels/check_kernels.sh "${EXL2_CUDA_ARCHS:-90}" >"$OUT/check.log" 2>&1
check_rc=$?
grep -E "^(FAIL|check_kernels)" "$OUT/check.log" | head -40

echo "== tests (pytest -m cuda)"
python3 -m pytest -m cuda -q -rfE ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25
test_rc=${PIPESTATUS[0]}
[ $test_rc -eq 5 ] && { echo "(no tests marked cuda were collected)"; test_rc=0; }
t_test=$(($(date +%s) - t0 - t_build))

echo "== bench"
python3 bench/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
t_bench=$(($(date +%s) - t0 - t_build - t_test))

echo "== SUMMARY"
echo "gpu:   $(head -1 "$OUT/gpu.txt")"
echo "build: ok (${t_build}s)"
echo "check: rc $check_rc: $(grep -E '^check_kernels:' "$OUT/check.log" | tr '\n' ' ')"
echo "tests: rc $test_rc (${t_test}s): $(grep -E '(passed|failed|error|skipped|deselected)' "$OUT/tests.log" | tail -1)"
echo "bench: rc $bench_rc (${t_bench}s): $(grep -c . "$OUT/bench.txt") lines in bench.txt"
[ $test_rc -ne 0 ] && exit 3
[ $check_rc -ne 0 ] && exit 2
[ $bench_rc -ne 0 ] && exit 4
exit 0
