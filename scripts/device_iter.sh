#!/usr/bin/env bash
# One device call for a kernel iteration (issue 4): scripts/device_quick.sh (build, GPU tests, bench_exl2) then
# scripts/device_profile.sh (decode step timing and Nsight Compute on the built tree), results packed into at most
# 8 files under $OUT: quick.txt, profile.txt, ncu_step_summary.txt, ncu_gemv.txt, gemv_sass.csv, gemv_details.txt,
# logs.tgz.
#   OUT=/tmp/out scripts/device_iter.sh      (QUICK_* / PROF_* variables pass through)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-iter}
mkdir -p "$OUT" /tmp/iter-q /tmp/iter-p
QUICK_PRESETS=${QUICK_PRESETS-} OUT=/tmp/iter-q scripts/device_quick.sh 2>&1 | tee "$OUT/quick.txt" | tail -40
PROF_SKIP_BUILD=1 OUT=/tmp/iter-p scripts/device_profile.sh 2>&1 | tee "$OUT/profile.txt" | tail -40
cp /tmp/iter-p/ncu_step_summary.txt /tmp/iter-p/ncu_gemv.txt /tmp/iter-p/gemv_sass.csv /tmp/iter-p/gemv_details.txt "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp iter-q iter-p 2>/dev/null
