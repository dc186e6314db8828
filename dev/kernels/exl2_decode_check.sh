#!/usr/bin/env bash
# Builds and runs dev/kernels/exl2_decode_check.cu on the host (no GPU needed): the EXL2 kernels' decoding and
# unit table against quant::dequantize_into. Needs build/dev-cuda (scripts/dev_build.sh cuda) for the library.
set -euo pipefail
cd "$(dirname "$0")/../.."
lib=build/dev-cuda/libexl2_runtime.a
[ -f "$lib" ] || { echo "build $lib first: scripts/dev_build.sh cuda" >&2; exit 1; }
nv=$(python3 -c "import nvidia,os; print(os.path.join(nvidia.__path__[0],'cu13'))" 2>/dev/null || echo /usr/local/cuda)
out=${TMPDIR:-/tmp}/exl2_decode_check
nvcc -std=c++17 -O2 --expt-relaxed-constexpr -DEXL2_WITH_CUDA=1 -Icpp/include -Icpp -I. -I"$nv/include" \
  dev/kernels/exl2_decode_check.cu "$lib" -Xlinker "$nv/lib/libcublas.so.13" -Xlinker "$nv/lib/libcublasLt.so.13" -Xlinker -rpath="$nv/lib" -o "$out"
"$out"
