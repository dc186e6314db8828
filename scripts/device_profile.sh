#!/usr/bin/env bash
# One device call for profiling (issue 4): build with CUDA, write a Llama-2-7B-shaped 4.0 bpw model (2 distinct
# layer variants), time batch-1 decode steps, then with Nsight Compute: (1) the duration of every kernel of one
# decode step (ncu_step.csv), (2) full sections for one layer's EXL2 GEMV launches (ncu_gemv.txt); and the graphs-
# vs-eager flake hunt on the EXL2 fixture (flaky.txt; needs EXL2CPP_FIXTURES, the folder holding exl2-smol4/). Files under $OUT.
#   OUT=/tmp/prof scripts/device_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# EXL2CPP_FIXTURES is the shared fixtures folder holding exl2-smol4/ (CONTRIBUTING.md "Fixtures"), as for the tests.
if [ -n "${EXL2CPP_FIXTURES:-}" ] && [ -f "$EXL2CPP_FIXTURES/fx_q40.safetensors" ]; then
  echo "EXL2CPP_FIXTURES=$EXL2CPP_FIXTURES is the exl2-smol4 folder itself: point it at the folder that holds" \
    "exl2-smol4/ (e.g. carry .devfx/exl2-smol4 and set EXL2CPP_FIXTURES=\$PWD/.devfx)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/exl2cpp-prof}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
stamp "build"
if [ "${PROF_SKIP_BUILD:-0}" != 1 ] && ! EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -40
  stamp "BUILD FAILED"
  exit 1
fi
export PYTHONPATH=$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=${PROF_MODEL:-/dev/shm/prof-l2-4.0}
if [ ! -f "$M/config.json" ]; then
  stamp "synth $M"
  python3 bench/synth_exl2.py --preset ${PROF_PRESET:-llama2-7b} --bpw ${PROF_BPW:-4.0} --out "$M" \
    --distinct-layers 2 >"$OUT/synth.log" 2>&1 || { tail -20 "$OUT/synth.log"; exit 1; }
fi
stamp "decode timing"
python3 dev/profile/profile_decode.py "$M" --steps 0 2>&1 | tee "$OUT/decode.txt"
python3 dev/profile/profile_decode.py "$M" --steps 0 --option cuda_graphs=false 2>&1 | sed 's/^/graphs off: /' | tee -a "$OUT/decode.txt"
if [ -n "${PROF_EXTRA:-}" ]; then stamp "extra"; bash -c "$PROF_EXTRA" 2>&1 | tee -a "$OUT/decode.txt"; fi
stamp "ncu: kernel durations of one decode step"
timeout 180 "$NCU" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
  python3 dev/profile/profile_decode.py "$M" --steps 1 --timed 4 >"$OUT/ncu_step.csv" 2>"$OUT/ncu_step.err"
python3 - "$OUT/ncu_step.csv" <<'PY' | tee "$OUT/ncu_step_summary.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("no ncu rows"); sys.exit()
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ui = h.index("Metric Unit")
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[1:]:
    v = float(r[vi].replace(",", "")); v = v / 1000 if r[ui] == "nsecond" else v * 1000 if r[ui] == "msecond" else v
    k = r[ki].split("(")[0][:90]; tot[k] += v; cnt[k] += 1
s = sum(tot.values())
print(f"one decode step: {sum(cnt.values())} kernels, {s:.0f} us of kernel time (serialized by ncu)")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"{v:9.1f} us {100 * v / s:5.1f}% {cnt[k]:5d}x  {k}")
PY
stamp "ncu: GEMV sections"
timeout 150 "$NCU" --clock-control none --profile-from-start off -k regex:exl2_gemv --launch-count ${PROF_GEMV_N:-7} \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
  --section Occupancy --section LaunchStats --section InstructionStats --section ComputeWorkloadAnalysis \
  python3 dev/profile/profile_decode.py "$M" --steps 1 --timed 4 >"$OUT/ncu_gemv.txt" 2>&1
stamp "ncu: per-instruction counts of one GEMV launch (PROF_PC_SKIP-th GEMV of the step; 4 = gate)"
timeout 150 "$NCU" --clock-control none --profile-from-start off -k regex:exl2_gemv --launch-skip ${PROF_PC_SKIP:-4} \
  --launch-count 1 --section SourceCounters --section InstructionStats -f -o /tmp/gemv_pc \
  python3 dev/profile/profile_decode.py "$M" --steps 1 --timed 4 >/tmp/ncu_pc.log 2>&1
"$NCU" --import /tmp/gemv_pc.ncu-rep --page source --print-source sass --csv >"$OUT/gemv_sass.csv" 2>&1 || tail -5 /tmp/ncu_pc.log
"$NCU" --import /tmp/gemv_pc.ncu-rep --page details --print-details all >"$OUT/gemv_details.txt" 2>&1
if [ -n "${EXL2CPP_FIXTURES:-}" ]; then
  stamp "flake hunt"
  timeout 120 python3 dev/profile/flaky_graphs.py ${PROF_FLAKY_RUNS:-8} 2>&1 | tee "$OUT/flaky.txt" | tail -20
fi
stamp "done"
