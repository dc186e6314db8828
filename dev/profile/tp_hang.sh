#!/usr/bin/env bash
# Diagnose a hang of a tensor-parallel test on the 2-GPU machine: run one pytest selection with the given env in the
# background (pytest dumps every Python thread's stack after WAIT - 10 s); if it is still running after WAIT seconds,
# dump every native thread's stack with gdb where the machine has it, then kill it.
#   OUT=... WAIT=40 dev/profile/tp_hang.sh "-k exl2_matches tests/test_tensor_parallel.py" [tag]
set -uo pipefail
sel=$1; tag=${2:-hang}; WAIT=${WAIT:-40}
python3 -m pytest -m cuda2 -q -x -p no:cacheprovider -o faulthandler_timeout=$((WAIT - 10)) $sel >"$OUT/$tag.log" 2>&1 &
pid=$!
for _ in $(seq "$WAIT"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
if kill -0 $pid 2>/dev/null; then
  echo "$tag: still running after ${WAIT}s: gdb backtraces in $tag.log" | tee -a "$OUT/$tag.log"
  for p in $(pgrep -P $pid) $pid; do
    gdb -p "$p" -batch -ex "thread apply all bt 14" >>"$OUT/$tag.log" 2>&1
  done
  kill -9 $pid 2>/dev/null
fi
wait $pid; echo "$tag: rc $?"; tail -3 "$OUT/$tag.log"
