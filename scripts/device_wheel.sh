#!/usr/bin/env bash
# On the GPU machine: installs a built wheel into a fresh --target folder (no build, no index), runs the GPU tests
# against that installed package (not the checkout's python/), and one `exl2cpp run` on a synthetic
# Llama-2-7B-shaped 4.0 bpw EXL2 model.
#   OUT=/tmp/out scripts/device_wheel.sh [WHEEL_DIR]      WHEEL_DIR: default dist/wheelhouse (carry it)
# WHEEL_DIR holds the exl2cpp wheel for this machine's Python and the wheels of any requirement the machine lacks
# (on the H200 image: gguf). nvidia-cublas / nvidia-cuda-runtime are the machine's own: their nvidia/cu13 folder is
# linked into the target, where pip would put them, so the wheel's RPATH ($ORIGIN/../nvidia/cu13/lib) is what
# finds them. env: PYTEST_ARGS, TESTS (test files or folders, default tests), TEST_CAP_S (330), RUN_TOKENS (128),
# SPEC_BENCH=1 (then bench/bench_spec.py on the installed package: speculative decoding on a synthetic 7B, into
# spec.txt / spec.jsonl; SPEC_ARGS more arguments, e.g. "--new 128").
# Files under $OUT: summary.txt install.log tests.log run.log (spec.txt spec.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-wheel}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
dir=${1:-dist/wheelhouse}
py=${PYTHON:-python3}
t0=$(date +%s)
: >"$OUT/summary.txt"
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"

tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
whl=$(ls "$dir"/exl2cpp-*-"$tag"-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || { stamp "no exl2cpp wheel for $tag in $dir: $(ls "$dir")"; exit 1; }
T=$(mktemp -d /tmp/exl2cpp-target.XXXXXX)
others=$(ls "$dir"/*.whl | grep -v '/exl2cpp-' || true)
stamp "install $(basename "$whl") (+ $(echo $others | wc -w) dependency wheels) into $T"
# shellcheck disable=SC2086
"$py" -m pip install --no-index --no-deps --no-compile --target "$T" "$whl" $others >"$OUT/install.log" 2>&1 ||
  { tail -5 "$OUT/install.log" | tee -a "$OUT/summary.txt"; exit 1; }
nv=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null)
[ -d "$nv/lib" ] || { stamp "this machine has no nvidia/cu13 (pip install nvidia-cublas nvidia-cuda-runtime)"; exit 1; }
mkdir -p "$T/nvidia" && ln -sfn "$nv" "$T/nvidia/cu13"
export PYTHONPATH=$T
# Every requirement of the wheel is importable with a matching version (none was installed from an index).
(cd /tmp && "$py" - "$T" <<'EOF') 2>&1 | tee -a "$OUT/summary.txt" || exit 1
import importlib.metadata as md, sys
from packaging.requirements import Requirement
reqs = [Requirement(r) for r in md.requires("exl2cpp") or []]
bad = []
for r in reqs:
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    try:
        v = md.version(r.name)
    except md.PackageNotFoundError:
        bad.append(f"{r} (missing)")
        continue
    if not r.specifier.contains(v, prereleases=True):
        bad.append(f"{r} (have {v})")
print("requirements:", ", ".join(str(r) for r in reqs if r.marker is None))
if bad:
    sys.exit("unmet: " + "; ".join(bad))
import exl2cpp
from exl2cpp import _C
assert exl2cpp.__file__.startswith(sys.argv[1]), exl2cpp.__file__
print("exl2cpp from", exl2cpp.__file__)
print("build_info", _C.build_info())
print("cuda devices", _C.cuda_device_count())
EOF
ldd "$T"/exl2cpp/_C*.so | grep -E "cublas|cudart|not found" | tee -a "$OUT/summary.txt"

rc=0
stamp "pytest -m cuda against the installed package ${PYTEST_ARGS:-}"
# tests/ of the checkout, python/ kept off the path: `import exl2cpp` is the target's
# shellcheck disable=SC2086
timeout -k 5 "${TEST_CAP_S:-330}" "$py" -m pytest -m cuda -q -rfE -p no:cacheprovider ${PYTEST_ARGS:-} ${TESTS:-tests} \
  >"$OUT/tests.log" 2>&1 || rc=3
grep -E "^(FAILED|ERROR)|passed|failed|no tests ran" "$OUT/tests.log" | tail -30 | tee -a "$OUT/summary.txt"

m=/dev/shm/exl2-bench-models/llama2-7b-4.0
stamp "synthesize $m"
"$py" bench/synth_exl2.py --preset llama2-7b --bpw 4.0 --out-dir /dev/shm/exl2-bench-models --skip-existing \
  >>"$OUT/run.log" 2>&1 || { stamp "synth failed"; tail -5 "$OUT/run.log" | tee -a "$OUT/summary.txt"; exit 4; }
stamp "exl2cpp run (installed console script) on cuda"
start=$(date +%s%N)
if timeout -k 5 300 "$T/bin/exl2cpp" run "$m" "The wheel runs on the GPU" --device cuda --raw \
  --max-new-tokens "${RUN_TOKENS:-128}" --temperature 0 >>"$OUT/run.log" 2>&1; then
  stamp "run ok in $(( ($(date +%s%N) - start) / 1000000 )) ms (load + ${RUN_TOKENS:-128} tokens)"
else
  rc=5
  stamp "run FAILED"
  tail -8 "$OUT/run.log" | tee -a "$OUT/summary.txt"
fi
if [ "${SPEC_BENCH:-0}" = 1 ]; then
  stamp "bench/bench_spec.py on the installed package"
  # shellcheck disable=SC2086
  timeout -k 5 "${SPEC_CAP_S:-300}" "$py" bench/bench_spec.py --work /dev/shm/exl2-spec --device cuda \
    --json "$OUT/spec.jsonl" ${SPEC_ARGS:-} >"$OUT/spec.txt" 2>&1 || { rc=6; stamp "bench_spec FAILED"; }
  tail -30 "$OUT/spec.txt" | tee -a "$OUT/summary.txt"
fi
stamp "done rc=$rc"
exit $rc
