#!/usr/bin/env bash
# One device call after a kernel change (issue 4): build, the whole GPU test suite (pytest -m cuda; EXL2 fixtures
# from $EXL2CPP_FIXTURES/exl2-smol4 when carried), then where a Llama-2-7B-shaped 4.0 bpw step's time goes: ncu kernel
# durations of one batch-1 decode step and of one 2048-token prefill, summed per kernel (dev/profile/kernel_table.py).
#   OUT=/tmp/out scripts/device_check.sh      env: CHECK_TESTS=0 (skip tests), CHECK_PROFILE=0, PYTEST_ARGS,
#   CHECK_PREFILL=2048, EXL2_CUDA_ARCHS=90, CHECK_SKIP_BUILD=1, CHECK_PROFILE_OPTIONS (one more ncu decode step with
#   those runtime options, space-separated NAME=VALUE (docs/options.md), e.g. "gemv_fuse=false")
# Files under $OUT: build.log tests.log profile.txt summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# EXL2CPP_FIXTURES is the shared fixtures folder holding exl2-smol4/ (CONTRIBUTING.md "Fixtures"), as for the tests.
if [ -n "${EXL2CPP_FIXTURES:-}" ] && [ -f "$EXL2CPP_FIXTURES/fx_q40.safetensors" ]; then
  echo "EXL2CPP_FIXTURES=$EXL2CPP_FIXTURES is the exl2-smol4 folder itself: point it at the folder that holds" \
    "exl2-smol4/ (e.g. carry .devfx/exl2-smol4 and set EXL2CPP_FIXTURES=\$PWD/.devfx)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/exl2cpp-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
if [ "${CHECK_SKIP_BUILD:-0}" != 1 ]; then
  stamp build
  if ! EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1; then
    grep -E "error|FAILED" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"
    stamp "BUILD FAILED"
    exit 1
  fi
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
rc=0
if [ "${CHECK_TESTS:-1}" != 0 ]; then
  stamp "pytest -m cuda ${PYTEST_ARGS:-}"
  # shellcheck disable=SC2086
  timeout -k 5 "${CHECK_TEST_CAP_S:-330}" python3 -m pytest -m cuda -q -rfE --durations=15 ${PYTEST_ARGS:-} >"$OUT/tests.log" 2>&1 || rc=3
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -30 | tee -a "$OUT/summary.txt"
fi
if [ "${CHECK_PROFILE:-1}" != 0 ]; then
  dir=/dev/shm/exl2-bench-models
  stamp "synthesize llama2-7b-4.0"
  python3 bench/synth_exl2.py --preset llama2-7b --bpw 4.0 --out-dir "$dir" --skip-existing >/dev/null 2>&1
  m=$dir/llama2-7b-4.0
  : >"$OUT/profile.txt"
  for what in "decode --steps 1 --timed 32" "prefill --prefill ${CHECK_PREFILL:-2048}"; do
    set -- $what
    name=$1
    shift
    stamp "ncu: $name"
    timeout -k 5 120 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      python3 dev/profile/profile_decode.py "$m" "$@" >/tmp/ncu_$name.csv 2>&1
    { echo "== $name ($*)"; grep -E "wall" /tmp/ncu_$name.csv; python3 dev/profile/kernel_table.py /tmp/ncu_$name.csv; } \
      >>"$OUT/profile.txt" 2>&1
  done
  # CHECK_PROFILE_OPTIONS (e.g. "gemv_fuse=false"): the decode step once more with those options (kernels per step)
  if [ -n "${CHECK_PROFILE_OPTIONS:-}" ]; then
    stamp "ncu: decode with $CHECK_PROFILE_OPTIONS"
    opts=()
    for kv in $CHECK_PROFILE_OPTIONS; do opts+=(--option "$kv"); done
    timeout -k 5 120 ncu --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv python3 dev/profile/profile_decode.py "$m" --steps 1 --timed 32 \
      "${opts[@]}" >/tmp/ncu_decode_opts.csv 2>&1
    { echo "== decode ($CHECK_PROFILE_OPTIONS)"; grep -E "wall" /tmp/ncu_decode_opts.csv
      python3 dev/profile/kernel_table.py /tmp/ncu_decode_opts.csv; } >>"$OUT/profile.txt" 2>&1
  fi
  cat "$OUT/profile.txt" >>"$OUT/summary.txt"
fi
stamp "done (rc $rc)"
cat "$OUT/summary.txt"
exit $rc
