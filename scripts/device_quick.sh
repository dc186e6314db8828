#!/usr/bin/env bash
# One short device call for kernel work: build with CUDA, run chosen GPU tests, the EXL2 linear bench and one
# end-to-end model bench, logs under $OUT (build.log, tests.log, bench_exl2.txt, summary.txt: 4 files).
#   OUT=/tmp/out scripts/device_quick.sh
# Environment: QUICK_TESTS (pytest paths, default: the EXL2/model/graph GPU tests), QUICK_EXL2_ARGS (bench_exl2.py
# arguments, default --iters 50), QUICK_PRESETS / QUICK_BPWS (end-to-end bench, default llama2-7b 4.0; empty: skip),
# EXL2CPP_FIXTURES (the shared fixtures folder holding exl2-smol4/, e.g. a carried .devfx).
set -uo pipefail
cd "$(dirname "$0")/.."
# EXL2CPP_FIXTURES is the shared fixtures folder holding exl2-smol4/ (CONTRIBUTING.md "Fixtures"), as for the tests.
if [ -n "${EXL2CPP_FIXTURES:-}" ] && [ -f "$EXL2CPP_FIXTURES/fx_q40.safetensors" ]; then
  echo "EXL2CPP_FIXTURES=$EXL2CPP_FIXTURES is the exl2-smol4 folder itself: point it at the folder that holds" \
    "exl2-smol4/ (e.g. carry .devfx/exl2-smol4 and set EXL2CPP_FIXTURES=\$PWD/.devfx)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/exl2cpp-quick}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
stamp "build"
if ! EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -40
  stamp "BUILD FAILED"
  exit 1
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
stamp "tests"
tests=${QUICK_TESTS-tests/test_exl2_cuda.py tests/test_cuda_models.py tests/test_cuda_graphs.py}
test_rc=0
if [ -n "$tests" ]; then
  python3 -m pytest -q -m cuda -rfE $tests 2>&1 | tee "$OUT/tests.log" | tail -30
  test_rc=${PIPESTATUS[0]}
fi
stamp "bench_exl2"
python3 bench/bench_exl2.py ${QUICK_EXL2_ARGS:---iters 50} 2>&1 | tee "$OUT/bench_exl2.txt"
if [ -n "${QUICK_PRESETS-llama2-7b}" ]; then
  stamp "end-to-end bench"
  BENCH_PRESETS=${QUICK_PRESETS-llama2-7b} BENCH_BPWS=${QUICK_BPWS:-4.0} BENCH_EXLV2=0 BENCH_ENGINE=${QUICK_ENGINE:-0} \
    BENCH_SKIP_BUILD=1 BENCH_BUDGET_S=${QUICK_BENCH_S:-400} OUT=/tmp/quick-bench scripts/device_bench.sh >/tmp/quick-bench.log 2>&1
  cp /tmp/quick-bench/summary.txt "$OUT/summary.txt" 2>/dev/null || tail -40 /tmp/quick-bench.log
  cat "$OUT/summary.txt" 2>/dev/null
  cp /tmp/quick-bench.log "$OUT/bench_e2e.log" 2>/dev/null
  cat /tmp/quick-bench/bench_exl2cpp.log >>"$OUT/bench_e2e.log" 2>/dev/null
  grep -iE "error|Traceback" "$OUT/bench_e2e.log" | head -10
fi
stamp "done (tests rc $test_rc)"
exit $test_rc
