#!/usr/bin/env bash
# Build dev/kernels/attention_bench.cu with cuda/attention.cu (no Python, no core library) and run it: correctness
# of the production dispatch and tile variants against a CPU reference, then timings (prefill TFLOP/s, decode
# GB/s next to the copy bandwidth). A second run with EXL2CPP_CUDA_REF=1 checks the reference kernel (checks only),
# a third with EXL2CPP_ATTN_PREFILL=rm2 the production dispatch's two-m-tile prefill (prefill checks and timings).
#   dev/kernels/attention_bench.sh [arch=90] [--quick|--build-only]    (PTXAS_V=1: ptxas -v register report too)
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${1:-90}
inc=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13','include'))" 2>/dev/null || echo .)
lib=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13','lib'))" 2>/dev/null || echo .)
out=${BENCH_BIN:-build/attention_bench}
mkdir -p "$(dirname "$out")"; rm -f "$out"
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DEXL2_WITH_CUDA=1 -Icpp/include -Icpp -I. -I"$inc" \
  -gencode=arch=compute_$arch,code=sm_$arch -Xptxas -warn-spills ${PTXAS_V:+-Xptxas -v} \
  dev/kernels/attention_bench.cu cuda/attention.cu cuda/pdl.cu cuda/stream.cu cuda/graph_exec.cu -o "$out" \
  -L"$lib" -l:libcublas.so.13 -Xlinker -rpath="$lib" 2>&1 | grep -v "^$" || true
test -x "$out"
[ "${2:-}" = "--build-only" ] && exit 0
rc=0
"$out" ${2:-} || rc=1
echo
echo "== EXL2CPP_CUDA_REF=1 (reference kernel; production rows only are meaningful)"
EXL2CPP_CUDA_REF=1 "$out" --quick 2>&1 | grep -E "production|mixed|decode batch|attention_bench:" | head -40 || true
echo
echo "== EXL2CPP_ATTN_PREFILL=rm2 (production prefill with two 16-row m-tiles per warp)"
EXL2CPP_ATTN_PREFILL=rm2 "$out" --prefill ${2:-} || rc=1
exit $rc
