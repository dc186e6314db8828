// Stand-ins for the CUDA device API when the library is built without the CUDA backend.
#ifndef EXL2_WITH_CUDA
#include <cstring>

#include "core/device_api.h"

namespace exl2::device {

#ifndef EXL2_NO_CUDA_REASON  // set by CMakeLists.txt
#define EXL2_NO_CUDA_REASON "it was built without the CUDA backend"
#endif

std::string cuda_missing_reason() { return EXL2_NO_CUDA_REASON; }

void require_cuda_backend(const std::string& what) {
  EXL2_FAIL(Unsupported, what, ": this build of exl2cpp has no CUDA backend (", EXL2_NO_CUDA_REASON,
            "); use device=\"cpu\", or rebuild with nvcc on PATH and cuBLAS (the toolkit's, or `pip install "
            "nvidia-cublas` and EXL2_CUBLAS_ROOT=<site-packages>/nvidia/cu13), e.g. `EXL2_CUBLAS_ROOT=... pip "
            "install --force-reinstall --no-deps .`");
}

static void no_cuda() { require_cuda_backend("CUDA requested"); }
bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { no_cuda(); return {}; }
void cuda_mem_info(int, size_t*, size_t*) { no_cuda(); }
void* cuda_malloc(size_t, int) { no_cuda(); return nullptr; }
void cuda_free(void*, int) {}
void cuda_synchronize(int) { no_cuda(); }
void copy(void* dst, Device dd, const void* src, Device sd, size_t n) {
  if (!dd.is_cpu() || !sd.is_cpu()) no_cuda();
  if (n) std::memcpy(dst, src, n);
}
void memset_zero(void* dst, Device d, size_t n) {
  if (!d.is_cpu()) no_cuda();
  if (n) std::memset(dst, 0, n);
}

}  // namespace exl2::device
#endif
