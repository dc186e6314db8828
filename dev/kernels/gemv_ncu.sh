#!/usr/bin/env bash
# Nsight Compute tests of the session-5 hypotheses on why the v4 EXL2 GEMV is not bandwidth bound
# (dev/kernels/exl2_gemv_notes.md, "Session 5"), in one device call (builds first when build/dev-cuda has no _C):
#   1. for the default and each knob setting of NCU_KNOBS: duration, DRAM throughput, L2/L1 hit rates, warps active,
#      issue activity and the stall shares (long scoreboard, barrier, membar, LG throttle) of layer 1's seven GEMV
#      launches in one decode step (synthetic Llama-2-7B 4.0 bpw, raw forward, ncu serialized, clocks unlocked);
#      a summary table per setting in summary.txt;
#   2. source-level stall samples (SASS) of layer 1's gate GEMV with the default options.
# Files under $OUT: ncu_<tag>.csv, gemv_pc_<tag>.csv, summary.txt.
#   OUT=/tmp/out dev/kernels/gemv_ncu.sh
# Environment: NCU_MODEL (default /dev/shm/exl2-bench-models/llama2-7b-4.0, made by gemv_ab.sh or here),
# NCU_KNOBS (';'-separated option sets, each space-separated NAME=VALUE runtime options (docs/options.md) passed as
# profile_decode.py's --option flags; "" or "default" = the default options), NCU_SOURCE (1: stage 2 too, default 1),
# NCU_CAP_S (seconds per ncu run, default 150). An option set with gemv_group=false has 7 GEMV launches per layer
# (q k v o gate up down); otherwise 4 (qkv o gateup down: one launch for each group).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/exl2cpp-gemv-ncu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=${NCU_MODEL:-/dev/shm/exl2-bench-models/llama2-7b-4.0}
: >"$OUT/summary.txt"
if ! ls build/dev-cuda/_C*.so >/dev/null 2>&1; then  # a fresh machine: build first (~3 min)
  echo "[$(date +%T)] build" | tee -a "$OUT/summary.txt"
  EXL2_CUDA_ARCHS=${EXL2_CUDA_ARCHS:-90} scripts/dev_build.sh cuda >"$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
fi
if [ ! -f "$M/config.json" ]; then
  python3 bench/synth_exl2.py --preset llama2-7b --bpw 4.0 --out-dir "$(dirname "$M")" --skip-existing \
    >"$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log" | tee -a "$OUT/summary.txt"; exit 1; }
fi
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
METRICS+=,l1tex__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active
METRICS+=,smsp__issue_active.avg.pct_of_peak_sustained_active
METRICS+=,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct
METRICS+=,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct
METRICS+=,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,launch__grid_size,launch__registers_per_thread
tag_of() { local t; t=$(echo "$1" | tr -s ' =' '_-'); echo "${t:-default}"; }
opt_flags() { local kv; for kv in $1; do [ "$kv" = default ] || printf -- '--option %s ' "$kv"; done; }
IFS=';' read -ra knobs <<<"${NCU_KNOBS:-default; gemv_chunks=4; gemv_prefetch=0; gemv_prefetch=32768; gemv_slices=1; gemv_group=false}"
for k in "${knobs[@]}"; do
  k=$(echo "$k" | sed 's/^ *//; s/ *$//')
  tag=$(tag_of "$k")
  echo "[$(date +%T)] ncu metrics: ${k:-default}" | tee -a "$OUT/summary.txt"
  # layer 0's GEMVs are skipped, layer 1's are measured
  per=4
  case " $k " in *gemv_group=false*|*gemv_group=0*) per=7 ;; esac
  # shellcheck disable=SC2046
  timeout "${NCU_CAP_S:-150}" "$NCU" --clock-control none --profile-from-start off -k regex:exl2_gemv \
    --launch-skip $per --launch-count $per --metrics "$METRICS" --csv \
    python3 dev/profile/profile_decode.py "$M" --steps 1 --timed 4 $(opt_flags "$k") >"$OUT/ncu_$tag.csv" \
    2>"$OUT/ncu_$tag.err"
  python3 - "$OUT/ncu_$tag.csv" "$per" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("  no ncu rows"); sys.exit()
h = rows[0]; ii = h.index("ID"); mi = h.index("Metric Name"); vi = h.index("Metric Value"); ui = h.index("Metric Unit")
by = collections.OrderedDict()
for r in rows[1:]:
    v = float(r[vi].replace(",", "")) if r[vi].replace(",", "").replace(".", "", 1).isdigit() else r[vi]
    if r[mi] == "gpu__time_duration.sum":
        v = v / 1000 if r[ui] == "nsecond" else v * 1000 if r[ui] == "msecond" else v
    by.setdefault(r[ii], {})[r[mi]] = v
short = [("gpu__time_duration.sum", "us"), ("dram__throughput", "dram%"), ("lts__t_sector_hit_rate", "L2hit%"),
         ("l1tex__t_sector_hit_rate", "L1hit%"), ("sm__warps_active", "warps%"), ("smsp__issue_active", "issue%"),
         ("long_scoreboard", "lsb%"), ("stalled_barrier", "bar%"), ("stalled_membar", "membar%"),
         ("lg_throttle", "lgthr%"), ("launch__grid_size", "grid"), ("registers", "regs")]
names = ["q", "k", "v", "o", "gate", "up", "down"] if sys.argv[2] == "7" else ["qkv", "o", "gateup", "down"]
print("  linear " + " ".join(f"{s:>7}" for _, s in short))
for n, (_, d) in zip(names, by.items()):
    vals = []
    for key, _ in short:
        v = next((d[m] for m in d if key in m), "")
        vals.append(f"{v:7.1f}" if isinstance(v, float) else f"{str(v):>7}")
    print(f"  {n:<6} " + " ".join(vals))
tot = sum(next((d[m] for m in d if "gpu__time" in m), 0.0) for d in by.values())
print(f"  layer: {tot:.1f} us over {len(by)} GEMVs")
PY
done
[ "${NCU_SOURCE:-1}" = 1 ] || { echo "[$(date +%T)] done" | tee -a "$OUT/summary.txt"; exit 0; }
for k in default; do
  tag=$(tag_of "$k")
  echo "[$(date +%T)] ncu source counters, gate/up GEMV of layer 1: ${k:-default}" | tee -a "$OUT/summary.txt"
  timeout 150 "$NCU" --clock-control none --profile-from-start off -k regex:exl2_gemv --launch-skip 6 \
    --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "/tmp/gemv_pc_$tag" \
    python3 dev/profile/profile_decode.py "$M" --steps 1 --timed 4 >"/tmp/gemv_pc_$tag.log" 2>&1
  "$NCU" --import "/tmp/gemv_pc_$tag.ncu-rep" --page source --print-source sass --csv >"$OUT/gemv_pc_$tag.csv" 2>&1 ||
    tail -5 "/tmp/gemv_pc_$tag.log" | tee -a "$OUT/summary.txt"
  "$NCU" --import "/tmp/gemv_pc_$tag.ncu-rep" --page details --print-details all 2>/dev/null |
    grep -iE "Duration|Stall|Warp Cycles|Issued Warp|Achieved Occupancy" | head -20 | tee -a "$OUT/summary.txt"
done
echo "[$(date +%T)] done" | tee -a "$OUT/summary.txt"
