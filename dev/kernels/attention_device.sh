#!/usr/bin/env bash
# One device call for the CUDA attention work (issue 4), results under $OUT:
#   attention_bench.txt  dev/kernels/attention_bench.sh: correctness of the production dispatch and tile variants
#                        vs a CPU fp64 reference, prefill TFLOP/s and decode GB/s (hot and L2-cold) next to the
#                        copy bandwidth, then the EXL2CPP_CUDA_REF=1 checks;
#   build.log, tests.log the module (EXL2_CUDA_ARCHS=90) and pytest -m cuda tests/test_backend_ops.py
#                        tests/test_attention_prefill.py (EXL2CPP_ATTN_PREFILL rm1 and rm2 vs the reference);
#   bench_decode.txt     bench/bench_decode.py --quick (its attention lines are the issue's numbers).
#   OUT=/tmp/out dev/kernels/attention_device.sh [bench]   (bench: the standalone bench only, ~2-3 min)
#   exit: 1 bench/check failed, 2 build, 3 tests, else 0
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/attn-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "warning: wheel install from .whl failed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
t0=$(date +%s)
echo "== attention_bench"
dev/kernels/attention_bench.sh 90 >"$OUT/attention_bench.txt" 2>&1
bench_rc=$?
cat "$OUT/attention_bench.txt"
[ "${1:-}" = bench ] && exit $((bench_rc != 0))
echo "== build ($(($(date +%s) - t0))s)"
EXL2_CUDA_ARCHS=90 scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1
build_rc=$?
tail -2 "$OUT/build.log"
[ $build_rc -ne 0 ] && { grep -E "error|FAILED" "$OUT/build.log" | head -20; exit 2; }
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
echo "== tests ($(($(date +%s) - t0))s)"
python3 -m pytest -m cuda -q -rfE tests/test_backend_ops.py tests/test_attention_prefill.py 2>&1 | tee "$OUT/tests.log" | tail -8
test_rc=${PIPESTATUS[0]}
echo "== bench_decode ($(($(date +%s) - t0))s)"
python3 bench/bench_decode.py --quick >"$OUT/bench_decode.txt" 2>&1
grep -E "attention|GB/s  \(" "$OUT/bench_decode.txt"
echo "== SUMMARY ($(($(date +%s) - t0))s): attention_bench rc $bench_rc, tests rc $test_rc"
[ $bench_rc -ne 0 ] && exit 1
[ $test_rc -ne 0 ] && exit 3
exit 0
