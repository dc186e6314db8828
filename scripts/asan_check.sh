#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer check: builds the CPU module with -fsanitize=address,undefined into
# build/asan-cpu (apart from the dev build), puts it beside a copy of the Python package in build/asan-cpu/py, and
# runs pytest there with libasan preloaded into the (uninstrumented) Python interpreter. Any heap overflow, use after
# free or undefined behaviour (signed overflow, bad shift, misaligned access...) aborts the process that hit it, and
# its test fails with the sanitizer's report.
#   scripts/asan_check.sh                      # the load-safety and overflow tests (tests/test_load_safety.py)
#   scripts/asan_check.sh tests/test_core.py   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
bdir=build/asan-cpu
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEXL2_BUILD_PYTHON=ON -DEXL2_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san" -DCMAKE_MODULE_LINKER_FLAGS="$san" \
  -DPython_EXECUTABLE="$(command -v "$py")" -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" >/dev/null
ninja -C "$bdir" _C

pkg=$bdir/py/exl2cpp  # a copy, not links: tests start child interpreters from the package's real location
rm -rf "$bdir/py"
mkdir -p "$pkg"
cp -r python/exl2cpp/. "$pkg"
rm -rf "$pkg"/_C*.so "$pkg"/__pycache__ "$pkg"/*/__pycache__
cp "$bdir"/_C*.so "$pkg/"

# libasan first; libstdc++ with it, so that ASan's __cxa_throw interceptor finds the real one (python does not link it).
libasan=$("${CXX:-c++}" -print-file-name=libasan.so)
libstdcxx=$(readlink -f "$("${CXX:-c++}" -print-file-name=libstdc++.so)")
[ -f "$libasan" ] || { echo "asan_check: libasan.so not found (got '$libasan')" >&2; exit 1; }
echo "asan_check: $(ls "$pkg"/_C*.so) with LD_PRELOAD=$libasan:$libstdcxx" >&2
# Leaks: the interpreter's own allocations at exit are not ours to judge.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
LD_PRELOAD="$libasan:$libstdcxx" PYTHONPATH="$bdir/py" "$py" -m pytest -q -p no:cacheprovider "${@:-tests/test_load_safety.py}"
