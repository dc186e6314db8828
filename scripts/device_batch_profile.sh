#!/usr/bin/env bash
# Where a batched decode step's time goes on the GPU (issue 17): a Llama-2-7B-shaped 4.0 bpw synthetic EXL2 model,
# B sequences of PROFILE_CTX tokens each decoded together in one raw forward (dev/profile/profile_decode.py
# --batch B), ncu kernel durations of one step summed per kernel (dev/profile/kernel_table.py), for each B in
# PROFILE_BATCHES. Needs a CUDA build in build/dev-cuda (scripts/dev_build.sh cuda) linked into python/exl2cpp.
#   OUT=/tmp/out scripts/device_batch_profile.sh     env: PROFILE_BATCHES ("1 8 32"), PROFILE_CTX (512),
#   PROFILE_PRESET (llama2-7b), PROFILE_BPW (4.0)
# File under $OUT: batch_profile.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exl2cpp-batch-profile}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
dir=/dev/shm/exl2-bench-models
preset=${PROFILE_PRESET:-llama2-7b}
bpw=${PROFILE_BPW:-4.0}
ctx=${PROFILE_CTX:-512}
f=$OUT/batch_profile.txt
python3 bench/synth_exl2.py --preset "$preset" --bpw "$bpw" --out-dir "$dir" --skip-existing >/dev/null 2>&1
m=$dir/$preset-$bpw
echo "== $preset $bpw bpw, ctx $ctx per sequence, one decode step per batch size" >"$f"
for b in ${PROFILE_BATCHES:-1 8 32}; do
  timeout -k 5 150 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 dev/profile/profile_decode.py "$m" --batch "$b" --ctx "$ctx" --steps 1 --timed 16 >/tmp/ncu_b$b.csv 2>&1
  { echo "== batch $b"; grep -E "wall|rror" /tmp/ncu_b$b.csv | head -5; python3 dev/profile/kernel_table.py /tmp/ncu_b$b.csv --top 14; } \
    >>"$f" 2>&1
done
cat "$f"
