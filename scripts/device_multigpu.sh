#!/usr/bin/env bash
# One call on the 2-GPU device machine (nvidia-h200-x2) for issue 8: build the CUDA backend, run the two-GPU tests
# (pytest -m cuda2: tests/test_multigpu.py layer split, tests/test_tensor_parallel.py tensor parallel through NCCL),
# bench/bench_multigpu.py (one GPU vs layer split vs tensor parallel), then the one-GPU model/engine tests
# (pytest -m cuda on the files covering the model, graphs and quantized caches) in the time left.
# NCCL: the image's nvidia-nccl-cu13 wheel (torch's dependency) is found on sys.path; a .whl/ folder with another
# version, if carried, is installed first. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
#   OUT=/tmp/out scripts/device_multigpu.sh     # env: EXL2_CUDA_ARCHS (default 90), PYTEST_ARGS, BENCH_ARGS,
#                                               #      BENCH_MODELS_DIR (default /dev/shm when it has room),
#                                               #      SKIP_TESTS=1 / SKIP_BENCH=1 (split the work over two calls)
# Files under $OUT: gpu.txt topo.txt build.log tests_cuda2.log tests_cuda.log bench_multigpu.txt bench.jsonl.
# Every phase has a time limit so the whole run stays under ~9 minutes. Prints a summary last.
# Exit status: 1 build failed, 3 tests failed, 4 benchmark failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "warning: wheel install from .whl failed"
fi
nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1 || true
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1 || true
cat "$OUT/gpu.txt"

stamp "== build (EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90})"
EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} timeout 260 scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1
build_rc=$?
tail -2 "$OUT/build.log"
if [ $build_rc -ne 0 ]; then
  grep -E "error|FAILED" "$OUT/build.log" | head -30
  stamp "== SUMMARY: BUILD FAILED (rc $build_rc); see build.log"
  exit 1
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import exl2cpp._C as C; print('exl2cpp._C: CUDA devices', C.cuda_device_count(), \
  [C.cuda_device_name(i) for i in range(C.cuda_device_count())])" 2>&1 | tee -a "$OUT/gpu.txt"

python3 -c "from exl2cpp import _C, tensor_parallel as tp; tp.prepare_nccl(); print('NCCL:', _C.nccl_describe())" \
  2>&1 | tee -a "$OUT/gpu.txt"

cuda2_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  stamp "== tests: pytest -m cuda2 tests/test_multigpu.py tests/test_tensor_parallel.py"
  timeout 200 python3 -m pytest -m cuda2 -q -rfEs --durations=8 ${PYTEST_ARGS:-} tests/test_multigpu.py \
    tests/test_tensor_parallel.py 2>&1 | tee "$OUT/tests_cuda2.log" | tail -40
  cuda2_rc=${PIPESTATUS[0]}
  [ $cuda2_rc -eq 5 ] && { echo "(no cuda2 tests collected)"; cuda2_rc=0; }
  [ $cuda2_rc -eq 124 ] && echo "(cuda2 tests stopped by the time limit: rc 124)"
else
  echo "(cuda2 tests skipped: SKIP_TESTS)" | tee "$OUT/tests_cuda2.log"
fi

stamp "== bench: bench/bench_multigpu.py (synthesizes llama3-8b 4.0 bpw if missing)"
models_dir=${BENCH_MODELS_DIR:-/tmp/exl2-bench-models}
if [ -z "${BENCH_MODELS_DIR:-}" ]; then
  shm_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  [ -n "$shm_kb" ] && [ "$shm_kb" -gt 16000000 ] && models_dir=/dev/shm/exl2-bench-models
fi
left=$((540 - ($(date +%s) - t0)))
[ $left -lt 120 ] && left=120
bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout $left python3 bench/bench_multigpu.py --models-dir "$models_dir" --json "$OUT/bench.jsonl" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_multigpu.txt"
  bench_rc=${PIPESTATUS[0]}
else
  echo "(bench skipped: SKIP_BENCH)" | tee "$OUT/bench_multigpu.txt"
fi

stamp "== tests: pytest -m cuda (one-GPU model, graphs, quantized caches; whatever time is left)"
left=$((560 - ($(date +%s) - t0)))
if [ $left -ge 30 ]; then
  timeout $left python3 -m pytest -m cuda -q -rfE ${PYTEST_ARGS:-} tests/test_cuda_models.py tests/test_cuda_graphs.py \
    tests/test_kv_quant.py 2>&1 | tee "$OUT/tests_cuda.log" | tail -15
  cuda_rc=${PIPESTATUS[0]}
  [ $cuda_rc -eq 5 ] && { echo "(no cuda tests collected)"; cuda_rc=0; }
  [ $cuda_rc -eq 124 ] && echo "(cuda tests stopped by the time limit: rc 124)"
else
  echo "(skipped: under 30 s left)" | tee "$OUT/tests_cuda.log"
  cuda_rc=0
fi

stamp "== SUMMARY"
echo "gpus:   $(grep -c . "$OUT/gpu.txt") lines in gpu.txt: $(head -2 "$OUT/gpu.txt" | tr '\n' ' ')"
echo "cuda2:  rc $cuda2_rc: $(grep -E '(passed|failed|error|skipped)' "$OUT/tests_cuda2.log" | tail -1)"
echo "cuda:   rc $cuda_rc: $(grep -E '(passed|failed|error|skipped)' "$OUT/tests_cuda.log" | tail -1)"
echo "bench:  rc $bench_rc:"; grep -E '^scaling' "$OUT/bench_multigpu.txt"
[ $cuda2_rc -ne 0 ] || [ $cuda_rc -ne 0 ] && exit 3
[ $bench_rc -ne 0 ] && exit 4
exit 0
