#!/usr/bin/env bash
# Register / spill / shared-memory report of the CUDA kernels (nvcc -Xptxas -v), one line per kernel.
#   dev/kernels/ptxas_report.sh [arch=90] [files...]   (default: every cuda/*.cu)
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${1:-90}; shift || true
files=${*:-$(ls cuda/*.cu)}
inc=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13','include'))" 2>/dev/null || echo .)
for f in $files; do
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DEXL2_WITH_CUDA=1 -Icpp/include -Icpp -I. -I"$inc" \
    -gencode=arch=compute_$arch,code=sm_$arch -Xptxas -v -c "$f" -o /dev/null 2>&1
done | python3 -c '
import re, subprocess, sys
cur = None
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(\w+). for .(sm_\d+)", line)
    if m:
        cur = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
        cur = re.sub(r"exl2::cuda::\(anonymous namespace\)::", "", cur)
        cur = re.sub(r"\(.*\)$", "", cur).replace("__nv_bfloat16", "bf16").replace("__half", "f16")
        stack = ""
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and cur: stack = f"stack {m.group(1)} spill st/ld {m.group(2)}/{m.group(3)}"
    m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line.strip())
    if m and cur:
        print(f"{cur:60s} regs {m.group(1):>3}  {stack}  smem {m.group(2) or 0}")
        cur = None
'
