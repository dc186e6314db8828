#!/usr/bin/env bash
# Static SASS of the EXL2 GEMV kernels (no GPU needed): compiles cuda/exl2_gemm.cu for sm_90 to a cubin, dumps SASS
# and prints the basic blocks of main's m = 1 kernel and of the v4 kernel (m = 1: v4, v4k, v4 L1P; m = 16) with their
# opcode counts. Per weight: a 4-bit chunk block of v4 covers 64 weights per thread; a unit of main's kernel 128.
#   dev/kernels/gemv_sass.sh [OUTDIR=/tmp/gemv_sass]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/gemv_sass}
mkdir -p "$out"
inc=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13','include'))" 2>/dev/null || echo .)
cuobjdump=$(command -v cuobjdump || echo /tmp/tri/x/triton/backends/nvidia/bin/cuobjdump)
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DEXL2_WITH_CUDA=1 -Icpp/include -Icpp -I. -I"$inc" \
  -gencode=arch=compute_90,code=sm_90 -Xptxas -v -cubin cuda/exl2_gemm.cu -o "$out/exl2_gemm.cubin" 2>"$out/ptxas.txt"
"$cuobjdump" -sass "$out/exl2_gemm.cubin" >"$out/exl2_gemm.sass"
# v4 kernels: <M, KC, L1P>; M 1: v4, v4k, the L1 prefetch variant; M 16: two n-tiles.
for f in 'exl2_gemv_kernelILi1E' 'exl2_gemv_v4_kernelILi1ELb0ELb0E' 'exl2_gemv_v4_kernelILi1ELb1ELb0E' \
  'exl2_gemv_v4_kernelILi1ELb0ELb1E' 'exl2_gemv_v4_kernelILi16ELb0ELb0E'; do
  python3 dev/kernels/sass_loops.py "$out/exl2_gemm.sass" "$f" 40
  echo
done
