#!/usr/bin/env bash
# Issue 17's batched-decode A/B in one device call, in priority order, each step only while BATCH_BUDGET_S lasts:
#   1. build (CUDA, sm_90; incremental on a warm machine), then `pytest -m cuda` of the 32-row GEMV
#      (tests/test_exl2_gemv_m32.py) and BATCH_TESTS (more test files);
#   2. bench/bench_rows.py: per-linear time at 1..128 rows, shipped planner vs option gemv_m32 (32-row launches,
#      also past 32 rows) vs dequantize + cuBLAS vs cuBLAS fp16 on the same shapes;
#   3. bench/bench_engine.py on a Llama-2-7B-shaped 4.0 bpw synthetic model at BATCH_JOBS concurrent jobs, once per
#      option set of BATCH_ENGINE_VARIANTS (";"-separated, each space-separated NAME=VALUE; "-" = the defaults);
#   4. BATCH_SPEC=1: bench/bench_spec.py (speculative decoding, verify rows as CUDA graphs) with SPEC_ARGS; SPEC_REAL
#      (e.g. "MODEL_DIR --real-draft 4 --new 128"): its realistic case, bench_spec.py --real $SPEC_REAL;
#   5. BATCH_PENDING=1 (last: it changes this copy of the tree): the dev/pending patches applied, rebuilt, their GPU
#      tests (dev/pending/README.md) run.
#   OUT=/tmp/out scripts/device_batch.sh
# Files under $OUT: summary.txt build.log tests.log rows.txt engine.txt spec.txt pending.log (rows.json with
# BATCH_ROWS_JSON=1). Environment: the BATCH_* names above, BATCH_*_CAP_S caps per step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-batch}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
budget=${BATCH_BUDGET_S:-560}
left() { echo $((t0 + budget - $(date +%s))); }
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
build() {
  if ! EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >>"$OUT/build.log" 2>&1; then
    grep -E "error|FAILED" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"
    stamp "BUILD FAILED"
    return 1
  fi
}
stamp build
build || exit 1
rc=0

stamp "GPU tests: tests/test_exl2_gemv_m32.py ${BATCH_TESTS:-}"
# shellcheck disable=SC2086
timeout -k 5 "${BATCH_TESTS_CAP_S:-150}" python3 -m pytest -m cuda -q -rfE tests/test_exl2_gemv_m32.py ${BATCH_TESTS:-} \
  >"$OUT/tests.log" 2>&1 || rc=3
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -15 | tee -a "$OUT/summary.txt"

if [ "$(left)" -gt 60 ]; then
  stamp "bench/bench_rows.py"
  json=()
  [ "${BATCH_ROWS_JSON:-0}" = 1 ] && json=(--json "$OUT/rows.json")
  # shellcheck disable=SC2086
  timeout -k 5 "${BATCH_ROWS_CAP_S:-120}" python3 bench/bench_rows.py ${BATCH_ROWS_ARGS:-} "${json[@]}" >"$OUT/rows.txt" 2>&1 \
    || { rc=4; stamp "bench_rows FAILED"; tail -5 "$OUT/rows.txt" | tee -a "$OUT/summary.txt"; }
fi

dir=/dev/shm/exl2-bench-models
if [ "$(left)" -gt 90 ]; then
  stamp "synthesize llama2-7b-4.0"
  python3 bench/synth_exl2.py --preset llama2-7b --bpw 4.0 --out-dir "$dir" --skip-existing >/dev/null 2>&1
  : >"$OUT/engine.txt"
  IFS=';' read -ra variants <<<"${BATCH_ENGINE_VARIANTS:--;gemv_m32=true;gemv_m32=true gemv_max_rows=128}"
  for v in "${variants[@]}"; do
    [ "$(left)" -gt 60 ] || { stamp "engine: out of budget before '$v'"; break; }
    opts=()
    [ "$v" != "-" ] && for kv in $v; do opts+=(--option "$kv"); done
    stamp "engine, options: $v"
    echo "== options: $v" >>"$OUT/engine.txt"
    timeout -k 5 "${BATCH_ENGINE_CAP_S:-150}" python3 bench/bench_engine.py "$dir/llama2-7b-4.0" \
      --concurrency "${BATCH_JOBS:-1,8,32,64,128}" --new-tokens "${BATCH_NEW:-128}" --max-seconds 20 "${opts[@]}" \
      >>"$OUT/engine.txt" 2>&1 || { rc=5; stamp "engine FAILED ($v)"; }
  done
  tail -40 "$OUT/engine.txt" >>"$OUT/summary.txt"
fi

if [ "${BATCH_SPEC:-0}" = 1 ] && [ "$(left)" -gt 90 ]; then
  stamp "bench/bench_spec.py ${SPEC_ARGS:-}"
  # shellcheck disable=SC2086
  timeout -k 5 $(($(left) - 10)) python3 bench/bench_spec.py --work /dev/shm/exl2-spec --device cuda ${SPEC_ARGS:-} \
    >"$OUT/spec.txt" 2>&1 || { rc=7; stamp "bench_spec FAILED or cut"; }
  tail -30 "$OUT/spec.txt" >>"$OUT/summary.txt"
fi
if [ -n "${SPEC_REAL:-}" ] && [ "$(left)" -gt 60 ]; then  # the realistic case: bench_spec.py --real $SPEC_REAL
  stamp "bench/bench_spec.py --real $SPEC_REAL"
  # shellcheck disable=SC2086
  timeout -k 5 $(($(left) - 10)) python3 bench/bench_spec.py --work /dev/shm/exl2-spec --device cuda --real $SPEC_REAL \
    >>"$OUT/spec.txt" 2>&1 || { rc=7; stamp "bench_spec --real FAILED or cut"; }
  tail -14 "$OUT/spec.txt" >>"$OUT/summary.txt"
fi
if [ "${BATCH_PENDING:-0}" = 1 ] && [ "$(left)" -gt 150 ]; then
  stamp "dev/pending patches: apply, rebuild, GPU tests"
  {
    git apply dev/pending/*.patch && echo "applied: $(ls dev/pending/*.patch | tr '\n' ' ')"
  } >"$OUT/pending.log" 2>&1
  if build; then
    timeout -k 5 60 python3 -m pytest -m cuda -q -rfE tests/test_backend_ops.py tests/test_moe_ops.py \
      -k "matmul_f16_x_into_f32_y or router_f32" >>"$OUT/pending.log" 2>&1 || rc=6
    timeout -k 5 $(($(left) - 20)) python3 -m pytest -m cuda -q -rfE \
      tests/test_exl2_gemv_v4.py tests/test_exl2_gemv_group.py tests/test_exl2_gemv_fuse.py tests/test_exl2_cuda.py \
      tests/test_exl2_matmul.py tests/test_moe_ops.py tests/test_arch_moe.py tests/test_cuda_graphs.py \
      tests/test_exl2_gemv_m32.py >>"$OUT/pending.log" 2>&1 || rc=6
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pending.log" | tail -15 | tee -a "$OUT/summary.txt"
  fi
fi

stamp "done (rc $rc)"
exit $rc
