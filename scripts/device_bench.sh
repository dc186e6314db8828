#!/usr/bin/env bash
# One device call for the benchmark suite (issues 4 and 6): build exl2cpp with CUDA, install the carried wheels
# (ExLlamaV2 0.3.2), JIT-build ExLlamaV2's extension in the background, write the synthetic EXL2 models, run our
# benches (bench_model, bench_engine), then ExLlamaV2's on the same folders, and print the comparison table last.
#   OUT=/tmp/out scripts/device_bench.sh [--dry-run | --cpu]
# Files under $OUT (8): gpu.txt build.log exlv2_build.log synth.log bench_exl2cpp.log bench_exllamav2.log
# results.jsonl summary.txt. Everything is budgeted to end inside BENCH_BUDGET_S seconds (default 560).
# Environment (all optional):
#   BENCH_PRESETS="llama2-7b llama3-8b"   BENCH_BPWS="2.5 4.0 6.0"   models to make and bench
#   BENCH_ENGINE=1          the issue-6 concurrent-jobs load (on llama2-7b at 4.0 bpw, or BENCH_ENGINE_MODEL)
#   BENCH_EXLV2=1           ExLlamaV2 runs (0: skip, e.g. when .whl has no exllamav2 wheel)
#   BENCH_CONCURRENCY=1,8,32,128   BENCH_STEPS=128   BENCH_REPS=3
#   BENCH_ENGINE_CAP_S=30 / BENCH_EXLV2_CAP_S=15   seconds per concurrency level before the rest is cancelled
#   BENCH_DISTINCT=0        distinct layer variants per synthetic model (0: all layers distinct)
#   BENCH_MODELS_DIR (default /dev/shm/exl2-bench-models when it has room, else /tmp/exl2-bench-models; kept
#   between calls on a warm machine)   BENCH_SKIP_BUILD=0   EXL2_CUDA_ARCHS=90   BENCH_BUDGET_S=560
# --dry-run: print the plan and the commands, run nothing. --cpu: the same pipeline on the CPU with the tiny preset
# and quick settings (no ExLlamaV2, no CUDA build; BENCH_SKIP_BUILD=1 reuses python/exl2cpp/_C): the test of this
# script.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
case "${1:-}" in
  --dry-run) mode=dry ;;
  --cpu) mode=cpu ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --cpu]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/exl2-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# ExLlamaV2's JIT extension in the checkout (ignored): a second call on a warm machine reuses it (~2.5 min saved)
mkdir -p .devcache && export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.devcache/torch_ext}
PY=${PYTHON:-python3}
t0=$(date +%s)
budget=${BENCH_BUDGET_S:-560}
deadline=$((t0 + budget))
left() { echo $((deadline - $(date +%s))); }
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }

presets=${BENCH_PRESETS:-llama2-7b llama3-8b}
bpws=${BENCH_BPWS:-2.5 4.0 6.0}
models_dir=${BENCH_MODELS_DIR:-/tmp/exl2-bench-models}
engine_model=${BENCH_ENGINE_MODEL:-llama2-7b-4.0}
device=cuda
quick=""
exlv2=${BENCH_EXLV2:-1}
conc=${BENCH_CONCURRENCY:-1,8,32,128}
steps=${BENCH_STEPS:-128}
reps=${BENCH_REPS:-3}
if [ $mode = cpu ]; then
  presets=tiny
  bpws=${BENCH_BPWS:-2.5 4.0}
  engine_model=tiny-4.0
  device=cpu
  quick=--quick
  exlv2=0
  models_dir=${BENCH_MODELS_DIR:-$OUT/models}
fi
# models live in RAM (/dev/shm) when it has room (~6 GiB a model): no disk writes, fast loads
if [ -z "${BENCH_MODELS_DIR:-}" ] && [ $mode != cpu ]; then
  shm_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  n_models=$(( $(echo $presets | wc -w) * $(echo $bpws | wc -w) ))
  if [ -n "$shm_kb" ] && [ "$shm_kb" -gt $(( (n_models * 6 + 8) * 1024 * 1024 )) ] 2>/dev/null; then
    models_dir=/dev/shm/exl2-bench-models
  fi
fi
names=()
for p in $presets; do for b in $bpws; do names+=("$p-$(printf '%.1f' "$b")"); done; done
folders=()
for n in "${names[@]}"; do folders+=("$models_dir/$n"); done
engine_dir=$models_dir/$engine_model
[[ " ${names[*]} " == *" $engine_model "* ]] || engine_dir=""
res=$OUT/results.jsonl

run() {  # run CMD with the time left minus a reserve for the report; log to a file
  local log=$1 reserve=$2
  shift 2
  local t=$(( $(left) - reserve ))
  if [ $mode = dry ]; then echo "  would run (<= ${t}s): $* >> $log"; return 0; fi
  if [ $t -lt 10 ]; then stamp "skipped (out of time): $*"; echo "skipped: out of time" >>"$log"; return 124; fi
  timeout -k 5 $t "$@" >>"$log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && stamp "TIMED OUT after ${t}s: $*"
  return $rc
}

stamp "bench plan: mode $mode, device $device, models: ${names[*]}, engine load on ${engine_dir:-none}," \
  "ExLlamaV2 ${exlv2}, budget ${budget}s, OUT=$OUT"
[ $mode = dry ] || : >"$res"

# ---- wheels (ExLlamaV2 and its missing dependencies travel in .whl/) ----
if [ $mode = gpu ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "warning: wheel install from .whl failed"
fi
if [ $mode = gpu ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader >"$OUT/gpu.txt" 2>&1
  df -h /tmp >>"$OUT/gpu.txt" 2>&1
  nproc >>"$OUT/gpu.txt"
fi

# ---- ExLlamaV2's JIT build in the background (import once; later imports load the cached extension) ----
jit_pid=""
if [ "$exlv2" = 1 ]; then
  if [ $mode = dry ]; then
    echo "  would run in the background: EXLLAMA_NO_SDPA=1 python3 -c 'import exllamav2' > exlv2_build.log"
  elif "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('exllamav2') else 1)"; then
    (EXLLAMA_NO_SDPA=1 timeout $(($(left) - 60)) nice -n 10 "$PY" -c \
      "import time; t = time.time(); import exllamav2; print('exllamav2', exllamav2.__version__, 'imported in', round(time.time() - t, 1), 's')" \
      >"$OUT/exlv2_build.log" 2>&1) &
    jit_pid=$!
  else
    echo "exllamav2 is not importable (no wheel in .whl/?): skipping its runs" | tee "$OUT/exlv2_build.log"
    exlv2=0
  fi
fi

# ---- build ----
if [ "${BENCH_SKIP_BUILD:-0}" = 1 ]; then
  stamp "build skipped (BENCH_SKIP_BUILD=1)"
else
  stamp "build ($device)"
  bmode=cuda
  [ $mode = cpu ] && bmode=cpu
  export EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90}
  run "$OUT/build.log" 60 scripts/dev_build.sh $bmode || {
    tail -30 "$OUT/build.log"; stamp "BUILD FAILED"; exit 1; }
fi
# The source tree's package only when it has a built module (dev builds); else the installed exl2cpp.
if compgen -G "python/exl2cpp/_C*.so" >/dev/null; then export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}; fi

# ---- synthetic models ----
# (the reserve for the benches after it scales with the budget: 240 s of the default 560, so a short budget still
# leaves the models time to be written)
stamp "synthesize ${#names[@]} model(s) into $models_dir"
mkdir -p "$models_dir" 2>/dev/null || true
synth_presets=$(echo $presets | tr ' ' ',')
synth_bpws=$(echo $bpws | tr ' ' ',')
run "$OUT/synth.log" $(( budget * 3 / 7 )) "$PY" bench/synth_exl2.py --preset "$synth_presets" --bpw "$synth_bpws" \
  --out-dir "$models_dir" --distinct-layers "${BENCH_DISTINCT:-0}" --skip-existing || { tail -20 "$OUT/synth.log"; stamp "SYNTH FAILED"; }
[ $mode = dry ] || cat "$OUT/synth.log"
[ $mode = gpu ] && df -h "$models_dir" | tail -1

# ---- wait for ExLlamaV2's build so that it does not steal CPU from our timings (but leave our benches ~5 min) ----
wait_jit() {  # wait_jit MIN_LEFT: poll until the build ends or fewer than MIN_LEFT seconds are left
  [ -n "$jit_pid" ] || return 0
  while kill -0 "$jit_pid" 2>/dev/null && [ "$(left)" -gt "$1" ]; do sleep 2; done
  kill -0 "$jit_pid" 2>/dev/null && { stamp "ExLlamaV2's build still running (it competes for CPU)"; return 0; }
  wait "$jit_pid" || { echo "ExLlamaV2 import failed:"; tail -20 "$OUT/exlv2_build.log"; exlv2=0; }
  jit_pid=""
  [ "$exlv2" = 1 ] && tail -1 "$OUT/exlv2_build.log"
}
if [ -n "$jit_pid" ]; then
  stamp "waiting for ExLlamaV2's JIT build"
  wait_jit 300
fi

# ---- our benches ----
stamp "bench_model (exl2cpp, $device)"
ours_reserve=20
[ "$exlv2" = 1 ] && ours_reserve=200
run "$OUT/bench_exl2cpp.log" $ours_reserve "$PY" bench/bench_model.py "${folders[@]}" --device $device \
  --steps "$steps" --reps "$reps" --json "$res" $quick
bm_rc=$?
[ $mode = dry ] || tail -$((${#folders[@]} + 3)) "$OUT/bench_exl2cpp.log"
if [ "${BENCH_ENGINE:-1}" = 1 ] && [ -n "$engine_dir" ]; then
  stamp "bench_engine (exl2cpp, $device)"
  [ "$exlv2" = 1 ] && ours_reserve=150
  run "$OUT/bench_exl2cpp.log" $ours_reserve "$PY" bench/bench_engine.py "$engine_dir" --device $device \
    --concurrency "$conc" --max-seconds "${BENCH_ENGINE_CAP_S:-30}" --json "$res" $quick
  [ $mode = dry ] || tail -8 "$OUT/bench_exl2cpp.log"
fi

# ---- ExLlamaV2 ----
[ -n "$jit_pid" ] && wait_jit 20
if [ "$exlv2" = 1 ]; then
  stamp "ExLlamaV2 (EXLLAMA_NO_SDPA=1, no flash-attn)"
  eng_args=()
  [ "${BENCH_ENGINE:-1}" = 1 ] && [ -n "$engine_dir" ] && eng_args=(--engine-model "$engine_dir" --concurrency "$conc")
  export EXLLAMA_NO_SDPA=1
  run "$OUT/bench_exllamav2.log" 15 "$PY" bench/bench_exllamav2.py "${folders[@]}" \
    "${eng_args[@]}" --steps "$steps" --reps "$reps" --max-seconds "${BENCH_EXLV2_CAP_S:-15}" --json "$res"
  [ $mode = dry ] || tail -$((${#folders[@]} + 4)) "$OUT/bench_exllamav2.log"
fi

# ---- the comparison table, last ----
stamp "done; summary"
if [ $mode = dry ]; then echo "  would run: python3 bench/report.py $res > summary.txt"; exit 0; fi
"$PY" bench/report.py "$res" >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
[ $bm_rc -eq 0 ] || exit 4
exit 0
