// The PDL switch of cuda/pdl.h: option pdl (exl2/options.h), the test override, and the per-device support probe.
#include <atomic>

#include "cuda/pdl.cuh"
#include "exl2/options.h"
#include "cuda/stream.h"

namespace exl2::cuda {

namespace {

constexpr int kMaxDevices = 64;  // as cuda/stream.cu

// The probe: its PTX virtual arch is the one every kernel of this build got for the device (one arch list).
__global__ void pdl_probe_kernel() {}

std::atomic<int> g_override{-1};
std::atomic<int> g_support[kMaxDevices];  // 0: not probed yet, 1: no PDL, 2: PDL

// Caller has made `device` current.
bool device_supports(int device) {
  if (device < 0 || device >= kMaxDevices) return false;
  int s = g_support[device].load(std::memory_order_relaxed);
  if (s == 0) {
    int major = 0;
    EXL2_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    bool ok = major >= 9;
    if (ok) {
      cudaFuncAttributes a{};
      if (cudaFuncGetAttributes(&a, pdl_probe_kernel) == cudaSuccess) {
        ok = a.ptxVersion >= 90;
      } else {
        cudaGetLastError();  // no image for this device: kernels cannot run anyway, PDL is off
        ok = false;
      }
    }
    s = ok ? 2 : 1;
    g_support[device].store(s, std::memory_order_relaxed);
  }
  return s == 2;
}

}  // namespace

bool pdl_enabled() {
  const int o = g_override.load(std::memory_order_relaxed);
  if ((o >= 0 ? o : int(runtime_options().pdl)) == 0) return false;
  int device = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&device));
  return device_supports(device);
}

bool pdl_enabled(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: nothing launches, nothing is a dependent
    return false;
  }
  if (device < 0 || device >= count) return false;
  DeviceGuard guard(device);
  return pdl_enabled();
}

void set_pdl_override(int mode) {
  EXL2_CHECK(mode >= -1 && mode <= 1, "set_pdl_override: -1 (option pdl), 0 (off) or 1 (on) expected, got ",
             mode);
  g_override.store(mode, std::memory_order_relaxed);
}

}  // namespace exl2::cuda
