#!/usr/bin/env bash
# A/B of the EXL2 decode GEMV in ONE device call (issue 4): main's kernels (default) against the opt-in v4 kernel
# (cuda/exl2_gemv_v4.cuh) in its two variants, EXL2CPP_GEMV=v4 (exact (q - z) weights) and v4k (zero point
# subtracted from the fp32 result: one HADD2 per weight pair less). Builds once, runs the EXL2 GPU tests with the
# variants forced, bench_exl2 --quick for all three (per-linear m = 1 times, the m = 1..64 sweep), then the
# end-to-end decode bench on a synthetic Llama-2-7B 4.0 bpw model for all three. Files under $OUT (8):
# build.log tests_v4.log bench_exl2_{main,v4,v4k}.txt e2e.txt synth.log summary.txt.
#   OUT=/tmp/out dev/kernels/gemv_ab.sh
# Environment: AB_SKIP_BUILD=1 (reuse the build), AB_TESTS=0 (skip the tests: tests/test_exl2_gemv_v4.py, both
# variants, then tests/test_exl2_cuda.py with EXL2CPP_GEMV=v4 and with v4k), AB_BLOCKS="2" (extra bench_exl2 runs of
# v4k with EXL2CPP_GEMV_BLOCKS_PER_SM=N each), AB_VARIANTS (default "main v4 v4k"), AB_E2E=0 (skip the model bench), AB_MODELS_DIR (default
# /dev/shm/exl2-bench-models, as scripts/device_bench.sh: a model made by an earlier call is reused),
# AB_STEPS (decode steps timed, default 128), AB_PRESET (default llama2-7b), AB_BPW (default 4.0).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/exl2cpp-gemv-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"

if [ "${AB_SKIP_BUILD:-0}" != 1 ]; then
  stamp "build"
  if ! EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1; then
    grep -E "error|FAILED" "$OUT/build.log" | head -40 | tee -a "$OUT/summary.txt"
    stamp "BUILD FAILED"
    exit 1
  fi
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

test_rc=0
if [ "${AB_TESTS:-1}" != 0 ]; then
  : >"$OUT/tests_v4.log"
  for v in v4 v4k; do
    files="tests/test_exl2_cuda.py"
    [ $v = v4 ] && files="tests/test_exl2_gemv_v4.py $files"
    stamp "GPU tests, EXL2CPP_GEMV=$v: $files"
    EXL2CPP_GEMV=$v timeout -k 5 200 python3 -m pytest -q -m cuda -rfE $files >>"$OUT/tests_v4.log" 2>&1 || test_rc=1
    tail -4 "$OUT/tests_v4.log" | tee -a "$OUT/summary.txt"
  done
fi

bench() {  # bench NAME [ENV=VALUE ...]: bench_exl2 --quick under the given environment
  local name=$1
  shift
  stamp "bench_exl2 --quick ($name: $*)"
  env "$@" timeout -k 5 150 python3 bench/bench_exl2.py --quick --iters 50 --prefill 16 >"$OUT/bench_exl2_$name.txt" 2>&1
  sed -n '/^Decode (m = 1)/,/^Prefill/p' "$OUT/bench_exl2_$name.txt" | grep -v "^Prefill" >>"$OUT/summary.txt"
  grep -E "m= *[0-9]+:|Error|Traceback" "$OUT/bench_exl2_$name.txt" | head -12 >>"$OUT/summary.txt"
}
variants=${AB_VARIANTS:-main v4 v4k}
for v in $variants; do bench $v EXL2CPP_GEMV=$v; done
for b in ${AB_BLOCKS:-}; do
  bench "v4k_bps$b" EXL2CPP_GEMV=v4k EXL2CPP_GEMV_BLOCKS_PER_SM=$b
  cat "$OUT/bench_exl2_v4k_bps$b.txt" >>"$OUT/bench_exl2_v4k.txt"
  rm -f "$OUT/bench_exl2_v4k_bps$b.txt"
done

if [ "${AB_E2E:-1}" = 1 ]; then
  preset=${AB_PRESET:-llama2-7b}
  bpw=${AB_BPW:-4.0}
  dir=${AB_MODELS_DIR:-/dev/shm/exl2-bench-models}
  name=$preset-$(printf '%.1f' "$bpw")
  stamp "synthesize $name into $dir"
  mkdir -p "$dir"
  timeout -k 5 200 python3 bench/synth_exl2.py --preset "$preset" --bpw "$bpw" --out-dir "$dir" --skip-existing \
    >"$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log" | tee -a "$OUT/summary.txt"; }
  : >"$OUT/e2e.txt"
  for v in $variants; do
    stamp "bench_model $name, EXL2CPP_GEMV=$v"
    echo "==== EXL2CPP_GEMV=$v" >>"$OUT/e2e.txt"
    EXL2CPP_GEMV=$v timeout -k 5 150 python3 bench/bench_model.py "$dir/$name" --ctx 0,2048 --steps "${AB_STEPS:-128}" \
      --prefill 512 --reps 1 >/tmp/gemv_ab_e2e.txt 2>&1
    cat /tmp/gemv_ab_e2e.txt >>"$OUT/e2e.txt"
    grep -iE "tok/s|decode|error|Traceback" /tmp/gemv_ab_e2e.txt | head -12 >>"$OUT/summary.txt"
  done
fi
stamp "done (tests rc $test_rc)"
cat "$OUT/summary.txt"
exit $test_rc
