#!/usr/bin/env bash
# Developer build: compile the runtime and the _C module into build/dev-<cpu|cuda> and link the module into
# python/exl2cpp/ so `PYTHONPATH=python pytest` runs against this checkout without reinstalling.
#   scripts/dev_build.sh            # CPU only (fast)
#   scripts/dev_build.sh cuda       # with the CUDA backend (EXL2_CUDA_ARCHS, default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-cpu}
py=${PYTHON:-python3}
bdir=build/dev-$mode
cuda=OFF
[ "$mode" = cuda ] && cuda=ON
cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXL2_BUILD_PYTHON=ON -DEXL2_CUDA=$cuda -DEXL2_NATIVE=ON \
  -DEXL2_CUDA_ARCHS="${EXL2_CUDA_ARCHS:-90}" -DPython_EXECUTABLE="$(command -v $py)" \
  -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" >/dev/null
ninja -C "$bdir" _C
so=$(ls "$bdir"/_C*.so | head -1)
ln -sf "$(realpath "$so")" python/exl2cpp/
echo "built $so -> python/exl2cpp/"
