#!/usr/bin/env bash
# EXL2 GEMV on the device in one call (issue 4): builds, runs the EXL2 GPU tests on both weight layouts, and
# measures main's layout and kernels (EXL2CPP_GEMV=main, the default) against the v4 layout (EXL2CPP_GEMV=v4, opt-in
# until this run: the layer's only copy of the weights, v4 kernel for 1-16 rows, prefill dequantizes from it) end to
# end with VRAM, then the v4 launch knobs
# (dev/kernels/exl2_gemv_notes.md, session 5 hypotheses). In this order, each stage skipped when the budget
# (AB_BUDGET_S, default 530 s) is spent:
#   1. build (scripts/dev_build.sh cuda)
#   2. tests/test_exl2_gemv_v4.py (v4 and v4k: m = 1..16, prefill 17..300, all widths, awkward shapes, one-hot
#      exactness on both paths, device bytes per layout)
#   3. end-to-end decode tok/s (bench/bench_model.py, ctx 0 and 2048, VRAM of the load) on a synthetic Llama-2-7B
#      4.0 bpw model for each variant of AB_VARIANTS
#   4. tests/test_exl2_cuda.py (every EXL2 GPU test on the v4 and the main layout)
#   5. bench_exl2 --quick for main and v4 (per-linear m = 1 times and VRAM MB of Llama-2-7B at 4.0 bpw, the
#      m = 1..64 fused/dequant sweep, prefill), then one --quick run per knob setting of AB_KNOBS
#   (after 1: dev/kernels/exl2_decode_check.sh, the host-side layout check, unless AB_HOSTCHECK=0)
# Files under $OUT: build.log hostcheck.log tests.log e2e.txt bench_exl2_<name>.txt knobs.txt synth.log summary.txt.
#   OUT=/tmp/out dev/kernels/gemv_ab.sh
# If it runs out of time, a second call on the warm machine continues with what was skipped, e.g.
#   AB_SKIP_BUILD=1 AB_TESTS=0 AB_E2E=0 OUT=/tmp/out2 dev/kernels/gemv_ab.sh
# Environment: AB_SKIP_BUILD=1, AB_TESTS=0 (skip 2 and 4), AB_E2E=0 (skip 3), AB_BENCH=0 (skip 5),
# AB_VARIANTS: ';'-separated env settings of the end-to-end runs (default
#   "EXL2CPP_GEMV=main; EXL2CPP_GEMV=v4; EXL2CPP_GEMV=v4 EXL2CPP_GEMV_PDL=1"),
# AB_KNOBS: ';'-separated env settings of the extra v4 bench_exl2 runs, in order of value (default below: PDL, the
#   L1 prefetch variant, both, 4 chunks per slice, one k slice, no L2 prefetch, no loop prefetch, a 32 KB start
#   prefetch, 2 blocks per SM, 16 chunks per slice),
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
name_of() { # env settings -> a file-name-safe tag
  local n=${1//EXL2CPP_GEMV_/}
  n=${n//EXL2CPP_GEMV=/}
  n=$(echo "$n" | tr -s ' =' '_-' | sed 's/^_//; s/_$//')
  echo "${n:-default}"
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
  stamp "tests/test_exl2_gemv_v4.py (v4 and v4k)"
  run "$OUT/tests.log" 120 python3 -m pytest -q -m cuda -rfE -x tests/test_exl2_gemv_v4.py || test_rc=1
  tail -8 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
fi

IFS=';' read -ra variants <<<"${AB_VARIANTS:-EXL2CPP_GEMV=main; EXL2CPP_GEMV=v4; EXL2CPP_GEMV=v4 EXL2CPP_GEMV_PDL=1}"
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
    # shellcheck disable=SC2086
    run /tmp/gemv_ab_e2e.txt 100 env $v python3 bench/bench_model.py "$dir/$model" --ctx 0,2048 \
      --steps "${AB_STEPS:-128}" --prefill 512 --reps 1
    cat /tmp/gemv_ab_e2e.txt >>"$OUT/e2e.txt"
    grep -iE "tok/s|VRAM|error|Traceback" /tmp/gemv_ab_e2e.txt | head -12 >>"$OUT/summary.txt"
  done
fi

if [ "${AB_TESTS:-1}" != 0 ]; then
  stamp "tests/test_exl2_cuda.py (v4 and main layouts)"
  run "$OUT/tests.log" 180 python3 -m pytest -q -m cuda -rfE tests/test_exl2_cuda.py || test_rc=1
  tail -6 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
fi

bench() { # bench NAME [ENV=VALUE ...]: bench_exl2 --quick under the given environment
  local name=$1
  shift
  stamp "bench_exl2 --quick ($name: $*)"
  run "$OUT/bench_exl2_$name.txt" 90 env "$@" python3 bench/bench_exl2.py --quick --iters 50 --prefill 512
  sed -n '/^Decode (m = 1)/,/^Prefill/p' "$OUT/bench_exl2_$name.txt" | grep -v "^Prefill" >>"$OUT/summary.txt"
  grep -E "m= *[0-9]+:|Error|Traceback|no CUDA" "$OUT/bench_exl2_$name.txt" | head -16 >>"$OUT/summary.txt"
}
if [ "${AB_BENCH:-1}" != 0 ]; then
  bench main EXL2CPP_GEMV=main
  bench v4 EXL2CPP_GEMV=v4
  IFS=';' read -ra knobs <<<"${AB_KNOBS:-EXL2CPP_GEMV_PDL=1; EXL2CPP_GEMV_L1=1; EXL2CPP_GEMV_L1=1 EXL2CPP_GEMV_PDL=1; EXL2CPP_GEMV_CHUNKS=4; EXL2CPP_GEMV_SLICES=1; EXL2CPP_GEMV_PREFETCH=0; EXL2CPP_GEMV_AHEAD=0; EXL2CPP_GEMV_PREFETCH=32768; EXL2CPP_GEMV_BLOCKS_PER_SM=2; EXL2CPP_GEMV_CHUNKS=16}"
  : >>"$OUT/knobs.txt"
  for k in "${knobs[@]}"; do
    [ -n "${k// /}" ] || continue
    n=$(name_of "$k")
    stamp "knob $k"
    : >/tmp/gemv_ab_knob.txt
    # shellcheck disable=SC2086
    run /tmp/gemv_ab_knob.txt 60 env EXL2CPP_GEMV=v4 $k python3 bench/bench_exl2.py --quick --iters 50 --prefill 16
    { echo "==== v4 with $k"; cat /tmp/gemv_ab_knob.txt; } >>"$OUT/knobs.txt"
    { echo "knob $n:"; sed -n '/^Decode (m = 1)/,/^Prefill/p' /tmp/gemv_ab_knob.txt | grep -E " (q|k|v|o|gate|up|down) |one layer"
      grep -E "^  m= *[0-9]+: fused" /tmp/gemv_ab_knob.txt  # the 1..64-row sweep (EXL2CPP_GEMV_M32 shows at 24 / 32)
      grep -E "Error|Traceback" /tmp/gemv_ab_knob.txt | head -3; } >>"$OUT/summary.txt"
  done
fi
stamp "done (tests rc $test_rc)"
cat "$OUT/summary.txt"
exit $test_rc
