#!/usr/bin/env bash
# Build dev/kernels/check_kernels.cu with the backend's sources (no Python, no core library) and run it twice:
# fast paths, then --reference (option cuda_reference). Usage: dev/kernels/check_kernels.sh [arch=90] [--build-only]
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${1:-90}
inc=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13','include'))" 2>/dev/null || echo .)
lib=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13','lib'))" 2>/dev/null || echo .)
out=${CHECK_BIN:-build/check_kernels}
mkdir -p "$(dirname "$out")"; rm -f "$out"
# Only the raw-pointer kernels: files that use Tensor (EXL2 GEMM, quantized cache, GPTQ, MoE, NCCL) need the core
# library; of that library, the options registry the kernels read (and the error names its checks use).
srcs="$(ls cuda/*.cu | grep -v -e device.cu -e bench.cu -e exl2_gemm.cu -e kv_quant.cu -e gptq.cu -e moe_exl2.cu -e nccl.cu) cpp/core/options.cpp cpp/core/errors.cpp"
nvcc -std=c++17 -O2 --expt-relaxed-constexpr -DEXL2_WITH_CUDA=1 -Icpp/include -Icpp -I. -I"$inc" \
  -gencode=arch=compute_$arch,code=sm_$arch dev/kernels/check_kernels.cu $srcs -o "$out" \
  -L"$lib" -l:libcublas.so.13 -Xlinker -rpath="$lib" 2>&1 | grep -v "^$" || true
test -x "$out"
[ "${2:-}" = "--build-only" ] && exit 0
rc=0
"$out" || rc=1
"$out" --reference || rc=1
exit $rc
