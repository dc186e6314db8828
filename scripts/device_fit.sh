#!/usr/bin/env bash
# `exl2cpp fit` on the GPU: build with CUDA, fit a Llama-2-7B-shaped fp16 source (a sparse file of the real shapes)
# at FIT_VRAM (default 9GiB, far below the H200's memory) and FIT_CTX (default 8192, fp16 cache), synthesize the
# chosen bpw (bench/synth_exl2.py), load it, run a full-context prefill, and report how close to the budget the load
# and the prefill came and that +0.1 bpw would not fit (bench/fit_check.py); then the GPU tests of compare/fit when
# the EXL2 fixtures are there ($EXL2CPP_FIXTURES). Outputs under $OUT: build.log, fit.txt, fit.json, tests.log.
#   OUT=/tmp/out scripts/device_fit.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-fit}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
[ -n "${FIT_SKIP_BUILD:-}" ] || EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1 ||
  { grep -E "error|FAILED" "$OUT/build.log" | head -40; echo "BUILD FAILED"; exit 1; }
stamp "built"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
stamp "fit check"
python3 bench/fit_check.py --vram "${FIT_VRAM:-9GiB}" --ctx "${FIT_CTX:-8192}" --cache "${FIT_CACHE:-fp16}" \
  --work "${FIT_WORK:-/tmp/fit-check}" --json "$OUT/fit.json" 2>&1 | tee "$OUT/fit.txt"
rc=${PIPESTATUS[0]}
if [ -n "${EXL2CPP_FIXTURES:-}" ]; then
  stamp "GPU tests"
  python3 -m pytest -q -m cuda -rfE tests/test_compare_fit.py 2>&1 | tee "$OUT/tests.log" | tail -15
fi
stamp "done (fit check rc=$rc)"
exit $rc
