#!/usr/bin/env bash
# One device call that validates and measures a session's kernel work (issues 4 and 6), for when device time is
# short: ExLlamaV2's JIT build starts first in the background, then scripts/device_check.sh (build, the whole GPU
# suite, ncu time per kernel of a decode step and a 2048 prefill), an end-to-end A/B of the launch options
# (dev/kernels/gemv_ab.sh stage 3), and scripts/device_bench.sh on what is left of the budget (no rebuild; the
# ExLlamaV2 extension is already built by then).
#   OUT=/tmp/out scripts/device_session.sh
# Environment: SESSION_SKIP_CHECK=1 (skip device_check: a warm machine already built and tested by an earlier call,
# e.g. `scripts/device_check.sh` alone), SESSION_BUDGET_S (default 560), SESSION_AB (the A/B variants: ';'-separated
# option sets, each space-separated NAME=VALUE runtime options (docs/options.md), "default" for none),
# SESSION_NCU (option sets for dev/kernels/gemv_ncu.sh's per-launch GEMV metrics: DRAM %, L2 hit, issue %, stall
# shares; default "default; gemv_slices=1" = the default and one k slice; "" skips it; into profile.txt),
# SESSION_KNOBS (option sets for bench_exl2's per-linear m = 1 times next to the default options, gemv_ab.sh
# stage 5; default "gemv_m32=true"; "" skips it; into profile.txt),
# BENCH_* as scripts/device_bench.sh (defaults here: llama2-7b at 2.5/4.0/6.0 bpw, engine load, 1 rep of 64 steps).
# Files under $OUT (8): summary.txt tests.log profile.txt e2e.txt bench.log results.jsonl bench_summary.txt
# build.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# ExLlamaV2's JIT extension in the checkout (ignored): a second call on a warm machine reuses it (~2.5 min saved)
mkdir -p .devcache && export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.devcache/torch_ext}
t0=$(date +%s)
budget=${SESSION_BUDGET_S:-560}
left() { echo $((budget - ($(date +%s) - t0))); }
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: wheel install from .whl failed"
  (EXLLAMA_NO_SDPA=1 PYTHONPATH=/tmp/site nice -n 10 timeout 400 python3 -c \
    "import time; t = time.time(); import exllamav2; print('exllamav2 JIT build + import', round(time.time() - t, 1), 's')" \
    >/tmp/exlv2_jit.log 2>&1) &
fi
rc=0
if [ "${SESSION_SKIP_CHECK:-0}" = 1 ]; then  # a warm machine that an earlier call built and tested on
  ls build/dev-cuda/_C*.so >/dev/null 2>&1 || { stamp "SESSION_SKIP_CHECK=1 but no build/dev-cuda: run without it"; exit 1; }
  stamp "device_check skipped (SESSION_SKIP_CHECK=1)"
else
  mkdir -p /tmp/dc
  OUT=/tmp/dc CHECK_TEST_CAP_S=${SESSION_TEST_CAP_S:-200} scripts/device_check.sh >/dev/null 2>&1
  rc=$?
  cat /tmp/dc/summary.txt >>"$OUT/summary.txt"
  cp /tmp/dc/tests.log /tmp/dc/profile.txt /tmp/dc/build.log "$OUT/" 2>/dev/null
  [ $rc = 1 ] && { stamp "BUILD FAILED"; exit 1; }
fi
export PYTHONPATH=$PWD/python
stamp "end-to-end A/B"
mkdir -p /tmp/ab
AB_SKIP_BUILD=1 AB_TESTS=0 AB_BENCH=0 AB_BUDGET_S=$(( $(left) > 120 ? 100 : 40 )) AB_STEPS=64 \
  AB_VARIANTS="${SESSION_AB:-gemv_group=false pdl=false; pdl=false; gemv_group=false; default}" \
  OUT=/tmp/ab dev/kernels/gemv_ab.sh >/dev/null 2>&1
cp /tmp/ab/e2e.txt "$OUT/e2e.txt" 2>/dev/null
grep -E "====|raw forward|engine:|VRAM|rror" /tmp/ab/e2e.txt >>"$OUT/summary.txt"
if [ -n "${SESSION_NCU-default; gemv_slices=1}" ] && [ "$(left)" -gt 240 ]; then
  stamp "GEMV ncu metrics (dev/kernels/gemv_ncu.sh, layer 1's launches)"
  mkdir -p /tmp/gn
  NCU_KNOBS="${SESSION_NCU-default; gemv_slices=1}" NCU_SOURCE=0 NCU_CAP_S=60 OUT=/tmp/gn dev/kernels/gemv_ncu.sh \
    >/dev/null 2>&1
  { echo "== GEMV ncu metrics"; cat /tmp/gn/summary.txt; } | tee -a "$OUT/profile.txt" >>"$OUT/summary.txt"
fi
if [ -n "${SESSION_KNOBS-gemv_m32=true}" ] && [ "$(left)" -gt 200 ]; then
  stamp "bench_exl2 per linear: default options and ${SESSION_KNOBS-gemv_m32=true} (dev/kernels/gemv_ab.sh stage 5)"
  mkdir -p /tmp/abk
  AB_SKIP_BUILD=1 AB_HOSTCHECK=0 AB_TESTS=0 AB_E2E=0 AB_KNOBS="${SESSION_KNOBS-gemv_m32=true}" OUT=/tmp/abk \
    timeout 120 dev/kernels/gemv_ab.sh >/dev/null 2>&1
  { echo "== bench_exl2 per linear (m = 1, graphs; the default options, then each option set)"; cat /tmp/abk/summary.txt; } \
    | tee -a "$OUT/profile.txt" >>"$OUT/summary.txt"
fi
b=$(( $(left) - 5 ))
stamp "device_bench.sh (budget ${b}s)"
if [ "$b" -gt 90 ]; then
  mkdir -p /tmp/db
  PYTHONPATH=/tmp/site BENCH_SKIP_BUILD=1 BENCH_BUDGET_S=$b BENCH_PRESETS=${BENCH_PRESETS:-llama2-7b} \
    BENCH_BPWS=${BENCH_BPWS:-2.5 4.0 6.0} BENCH_REPS=${BENCH_REPS:-1} BENCH_STEPS=${BENCH_STEPS:-64} \
    BENCH_ENGINE_CAP_S=${BENCH_ENGINE_CAP_S:-20} BENCH_EXLV2_CAP_S=${BENCH_EXLV2_CAP_S:-12} OUT=/tmp/db \
    scripts/device_bench.sh >"$OUT/bench.log" 2>&1
  cp /tmp/db/results.jsonl "$OUT/" 2>/dev/null
  cp /tmp/db/summary.txt "$OUT/bench_summary.txt" 2>/dev/null
  cat /tmp/db/bench_exl2cpp.log /tmp/db/bench_exllamav2.log /tmp/exlv2_jit.log >>"$OUT/bench.log" 2>/dev/null
fi
stamp "done (check rc $rc)"
cat "$OUT/bench_summary.txt" 2>/dev/null
exit $rc
