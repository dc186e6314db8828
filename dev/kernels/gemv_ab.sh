#!/usr/bin/env bash
# EXL2 GEMV on the device in one call (issue 4): builds, runs the EXL2 GPU tests, and measures end to end (with VRAM)
# and per linear how the runtime options of the v4 GEMV change its speed (docs/options.md; the variants that lost,
# main's layout, v4k, L1 prefetch and cluster split-k, are in dev/kernels/ and dev/kernels/exl2_gemv_notes.md).
# In this order, each stage skipped when the budget (AB_BUDGET_S, default 530 s) is spent:
#   1. build (scripts/dev_build.sh cuda)
#   2. tests/test_exl2_gemv_v4.py (m = 1..16, prefill 17..300, all widths, awkward shapes)
#   3. end-to-end decode tok/s (bench/bench_model.py, ctx 0 and 2048, VRAM of the load) on a synthetic Llama-2-7B
#      4.0 bpw model for each option set of AB_VARIANTS
#   4. tests/test_exl2_cuda.py (every EXL2 GPU test)
#   5. bench_exl2 --quick with the default options (per-linear m = 1 times and VRAM MB of Llama-2-7B at 4.0 bpw, the
#      m = 1..64 fused/dequant sweep, prefill), then one --quick run per option set of AB_KNOBS
#   (after 1: dev/kernels/exl2_decode_check.sh, the host-side layout check, unless AB_HOSTCHECK=0)
# Files under $OUT: build.log hostcheck.log tests.log e2e.txt bench_exl2_default.txt knobs.txt synth.log summary.txt.
#   OUT=/tmp/out dev/kernels/gemv_ab.sh
# If it runs out of time, a second call on the warm machine continues with what was skipped, e.g.
#   AB_SKIP_BUILD=1 AB_TESTS=0 AB_E2E=0 OUT=/tmp/out2 dev/kernels/gemv_ab.sh
# Environment: AB_SKIP_BUILD=1, AB_TESTS=0 (skip 2 and 4), AB_E2E=0 (skip 3), AB_BENCH=0 (skip 5),
# AB_VARIANTS: ';'-separated option sets of the end-to-end runs, each space-separated NAME=VALUE runtime options
#   passed as the drivers' --option flags, "default" for none (default
#   "default; gemv_group=false; gemv_fuse=false; pdl=false"),
# AB_KNOBS: ';'-separated option sets of the extra bench_exl2 runs, in order of value (default below: 4 chunks per
#   slice, one k slice, no L2 prefetch, no loop prefetch, a 32 KB start prefetch, 2 blocks per SM, 16 chunks per
#   slice, the 32-row launch for 17..32 rows),
# AB_MODELS_DIR (default /dev/shm/exl2-bench-models, shared with scripts/device_bench.sh: a model made by an
# earlier call is reused), AB_STEPS (default 128), AB_PRESET (llama2-7b), AB_BPW (4.0).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/exl2cpp-gemv-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
budget=${AB_BUDGET_S:-530}
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
name_of() { # an option set -> a file-name-safe tag
  local n
  n=$(echo "$1" | tr -s ' =' '_-' | sed 's/^_//; s/_$//')
  echo "${n:-default}"
}
opt_flags() { # an option set ("gemv_group=false pdl=false", or "default") -> the drivers' --option flags
  local kv
  for kv in $1; do [ "$kv" = default ] || printf -- '--option %s ' "$kv"; done
}

if [ "${AB_SKIP_BUILD:-0}" != 1 ]; then
  stamp "build"
  : >"$OUT/build.log"
  export EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90}
  if ! run "$OUT/build.log" 360 scripts/dev_build.sh cuda; then
    grep -E "error|FAILED" "$OUT/build.log" | head -40 | tee -a "$OUT/summary.txt"
    stamp "BUILD FAILED"
    exit 1
  fi
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
test_rc=0
: >>"$OUT/tests.log"

if [ "${AB_HOSTCHECK:-1}" != 0 ]; then  # the host-side layout/decode check (no GPU; ~10 s): the v4 scale codes
  stamp "dev/kernels/exl2_decode_check.sh"
  run "$OUT/hostcheck.log" 90 dev/kernels/exl2_decode_check.sh || test_rc=1
  tail -6 "$OUT/hostcheck.log" | tee -a "$OUT/summary.txt"
fi

if [ "${AB_TESTS:-1}" != 0 ]; then
  stamp "tests/test_exl2_gemv_v4.py"
  run "$OUT/tests.log" 120 python3 -m pytest -q -m cuda -rfE -x tests/test_exl2_gemv_v4.py || test_rc=1
  tail -8 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
fi

IFS=';' read -ra variants <<<"${AB_VARIANTS:-default; gemv_group=false; gemv_fuse=false; pdl=false}"
if [ "${AB_E2E:-1}" != 0 ]; then
  preset=${AB_PRESET:-llama2-7b}
  bpw=${AB_BPW:-4.0}
  dir=${AB_MODELS_DIR:-/dev/shm/exl2-bench-models}
  model=$preset-$(printf '%.1f' "$bpw")
  stamp "synthesize $model into $dir"
  mkdir -p "$dir"
  run "$OUT/synth.log" 200 python3 bench/synth_exl2.py --preset "$preset" --bpw "$bpw" --out-dir "$dir" \
    --skip-existing || tail -5 "$OUT/synth.log" | tee -a "$OUT/summary.txt"
  : >>"$OUT/e2e.txt"
  for v in "${variants[@]}"; do
    [ -n "${v// /}" ] || continue
    stamp "bench_model $model, $v"
    echo "==== $v" >>"$OUT/e2e.txt"
    : >/tmp/gemv_ab_e2e.txt
    # shellcheck disable=SC2046
    run /tmp/gemv_ab_e2e.txt 100 python3 bench/bench_model.py "$dir/$model" --ctx 0,2048 \
      --steps "${AB_STEPS:-128}" --prefill 512 --reps 1 $(opt_flags "$v")
    cat /tmp/gemv_ab_e2e.txt >>"$OUT/e2e.txt"
    grep -iE "tok/s|VRAM|error|Traceback" /tmp/gemv_ab_e2e.txt | head -12 >>"$OUT/summary.txt"
  done
fi

if [ "${AB_TESTS:-1}" != 0 ]; then
  stamp "tests/test_exl2_cuda.py"
  run "$OUT/tests.log" 180 python3 -m pytest -q -m cuda -rfE tests/test_exl2_cuda.py || test_rc=1
  tail -6 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
fi

bench() { # bench NAME [--option NAME=VALUE ...]: bench_exl2 --quick with those options
  local name=$1
  shift
  stamp "bench_exl2 --quick ($name: $*)"
  run "$OUT/bench_exl2_$name.txt" 90 python3 bench/bench_exl2.py --quick --iters 50 --prefill 512 "$@"
  sed -n '/^Decode (m = 1)/,/^Prefill/p' "$OUT/bench_exl2_$name.txt" | grep -v "^Prefill" >>"$OUT/summary.txt"
  grep -E "m= *[0-9]+:|Error|Traceback|no CUDA" "$OUT/bench_exl2_$name.txt" | head -16 >>"$OUT/summary.txt"
}
if [ "${AB_BENCH:-1}" != 0 ]; then
  bench default
  IFS=';' read -ra knobs <<<"${AB_KNOBS:-gemv_chunks=4; gemv_slices=1; gemv_prefetch=0; gemv_prefetch_ahead=false; gemv_prefetch=32768; gemv_blocks_per_sm=2; gemv_chunks=16; gemv_m32=true}"
  : >>"$OUT/knobs.txt"
  for k in "${knobs[@]}"; do
    [ -n "${k// /}" ] || continue
    n=$(name_of "$k")
    stamp "knob $k"
    : >/tmp/gemv_ab_knob.txt
    # shellcheck disable=SC2046
    run /tmp/gemv_ab_knob.txt 60 python3 bench/bench_exl2.py --quick --iters 50 --prefill 16 $(opt_flags "$k")
    { echo "==== options $k"; cat /tmp/gemv_ab_knob.txt; } >>"$OUT/knobs.txt"
    { echo "knob $n:"; sed -n '/^Decode (m = 1)/,/^Prefill/p' /tmp/gemv_ab_knob.txt | grep -E " (q|k|v|o|gate|up|down) |one layer"
      grep -E "^  m= *[0-9]+: fused" /tmp/gemv_ab_knob.txt  # the 1..64-row sweep (gemv_m32 shows at 24 / 32)
      grep -E "Error|Traceback" /tmp/gemv_ab_knob.txt | head -3; } >>"$OUT/summary.txt"
  done
fi
stamp "done (tests rc $test_rc)"
cat "$OUT/summary.txt"
exit $test_rc
