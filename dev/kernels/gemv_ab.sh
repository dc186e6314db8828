#!/usr/bin/env bash
# A/B of the EXL2 decode GEMV in one device call (issue 4): main's kernels (default) against the opt-in v4 kernel
# (cuda/exl2_gemv_v4.cuh) in its two variants, EXL2CPP_GEMV=v4 (exact (q - z) weights) and v4k (zero point
# subtracted from the fp32 result: one HADD2 per weight pair less). In this order, each stage skipped when the
# budget (AB_BUDGET_S, default 570 s) is spent:
#   1. build (scripts/dev_build.sh cuda)
#   2. tests/test_exl2_gemv_v4.py (both variants; m = 1..8, all widths, awkward shapes, one-hot exactness)
#   3. bench_exl2 --quick for each variant (per-linear m = 1 times of Llama-2-7B at 4.0 bpw, the m = 1..64 sweep)
#   4. end-to-end decode tok/s (bench/bench_model.py, ctx 0 and 2048) on a synthetic Llama-2-7B 4.0 bpw model
#   5. tests/test_exl2_cuda.py with EXL2CPP_GEMV=v4 and with v4k forced (every EXL2 GPU test through the variant)
# Files under $OUT (8): build.log tests_v4.log bench_exl2_{main,v4,v4k}.txt e2e.txt synth.log summary.txt.
#   OUT=/tmp/out dev/kernels/gemv_ab.sh
# If it runs out of time, a second call on the warm machine continues:
#   AB_SKIP_BUILD=1 AB_TESTS=0 AB_BENCH=0 OUT=/tmp/out2 dev/kernels/gemv_ab.sh      (e2e + the forced-variant tests)
# Environment: AB_SKIP_BUILD=1, AB_TESTS=0 (skip 2), AB_BENCH=0 (skip 3), AB_E2E=0 (skip 4), AB_FORCED=0 (skip 5),
# AB_VARIANTS (default "main v4 v4k"), AB_EXTRA (extra bench_exl2 runs of v4k, one per ';'-separated list of
# settings, e.g. "EXL2CPP_GEMV_CHUNKS=4; EXL2CPP_GEMV_CHUNKS=16; EXL2CPP_GEMV_BLOCKS_PER_SM=1": chunks per k slice,
# default 8; blocks per SM of the one wave, default what registers allow), AB_MODELS_DIR (default /dev/shm/exl2-bench-models, shared with
# scripts/device_bench.sh: a model made by an earlier call is reused), AB_STEPS (default 128), AB_PRESET
# (llama2-7b), AB_BPW (4.0).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/exl2cpp-gemv-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
budget=${AB_BUDGET_S:-570}
left() { echo $((budget - ($(date +%s) - t0))); }
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
# run LOG CAP CMD...: CMD with at most min(CAP, time left - 10) seconds, output appended to LOG
run() {
  local log=$1 cap=$2
  shift 2
  local t=$(($(left) - 10))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then
    stamp "skipped (out of time): $*"
    return 124
  fi
  timeout -k 5 "$t" "$@" >>"$log" 2>&1
}

if [ "${AB_SKIP_BUILD:-0}" != 1 ]; then
  stamp "build"
  : >"$OUT/build.log"
  export EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90}
  if ! run "$OUT/build.log" 400 scripts/dev_build.sh cuda; then
    grep -E "error|FAILED" "$OUT/build.log" | head -40 | tee -a "$OUT/summary.txt"
    stamp "BUILD FAILED"
    exit 1
  fi
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
variants=${AB_VARIANTS:-main v4 v4k}
test_rc=0
: >>"$OUT/tests_v4.log"

if [ "${AB_TESTS:-1}" != 0 ]; then
  stamp "tests/test_exl2_gemv_v4.py (v4 and v4k)"
  run "$OUT/tests_v4.log" 150 python3 -m pytest -q -m cuda -rfE tests/test_exl2_gemv_v4.py || test_rc=1
  tail -6 "$OUT/tests_v4.log" | tee -a "$OUT/summary.txt"
fi

bench() {  # bench NAME [ENV=VALUE ...]: bench_exl2 --quick under the given environment
  local name=$1
  shift
  stamp "bench_exl2 --quick ($name: $*)"
  run "$OUT/bench_exl2_$name.txt" 120 env "$@" python3 bench/bench_exl2.py --quick --iters 50 --prefill 16
  sed -n '/^Decode (m = 1)/,/^Prefill/p' "$OUT/bench_exl2_$name.txt" | grep -v "^Prefill" >>"$OUT/summary.txt"
  grep -E "m= *[0-9]+:|Error|Traceback|no CUDA" "$OUT/bench_exl2_$name.txt" | head -12 >>"$OUT/summary.txt"
}
if [ "${AB_BENCH:-1}" != 0 ]; then
  for v in $variants; do bench "$v" EXL2CPP_GEMV="$v"; done
  IFS=';' read -ra extras <<<"${AB_EXTRA:-}"
  for ex in "${extras[@]}"; do
    [ -n "${ex// /}" ] || continue
    # shellcheck disable=SC2086
    bench v4k_extra EXL2CPP_GEMV=v4k $ex
    { echo "==== v4k with $ex"; cat "$OUT/bench_exl2_v4k_extra.txt"; } >>"$OUT/bench_exl2_v4k.txt"
    rm -f "$OUT/bench_exl2_v4k_extra.txt"
  done
fi

if [ "${AB_E2E:-1}" != 0 ]; then
  preset=${AB_PRESET:-llama2-7b}
  bpw=${AB_BPW:-4.0}
  dir=${AB_MODELS_DIR:-/dev/shm/exl2-bench-models}
  name=$preset-$(printf '%.1f' "$bpw")
  stamp "synthesize $name into $dir"
  mkdir -p "$dir"
  run "$OUT/synth.log" 200 python3 bench/synth_exl2.py --preset "$preset" --bpw "$bpw" --out-dir "$dir" \
    --skip-existing || tail -5 "$OUT/synth.log" | tee -a "$OUT/summary.txt"
  : >>"$OUT/e2e.txt"
  for v in $variants; do
    stamp "bench_model $name, EXL2CPP_GEMV=$v"
    echo "==== EXL2CPP_GEMV=$v" >>"$OUT/e2e.txt"
    : >/tmp/gemv_ab_e2e.txt
    run /tmp/gemv_ab_e2e.txt 150 env EXL2CPP_GEMV="$v" python3 bench/bench_model.py "$dir/$name" --ctx 0,2048 \
      --steps "${AB_STEPS:-128}" --prefill 512 --reps 1
    cat /tmp/gemv_ab_e2e.txt >>"$OUT/e2e.txt"
    grep -iE "tok/s|error|Traceback" /tmp/gemv_ab_e2e.txt | head -12 >>"$OUT/summary.txt"
  done
fi

if [ "${AB_FORCED:-1}" != 0 ]; then
  for v in v4 v4k; do
    stamp "tests/test_exl2_cuda.py with EXL2CPP_GEMV=$v"
    run "$OUT/tests_v4.log" 150 env EXL2CPP_GEMV="$v" python3 -m pytest -q -m cuda -rfE tests/test_exl2_cuda.py || test_rc=1
    tail -4 "$OUT/tests_v4.log" | tee -a "$OUT/summary.txt"
  done
fi
stamp "done (tests rc $test_rc)"
cat "$OUT/summary.txt"
exit $test_rc
